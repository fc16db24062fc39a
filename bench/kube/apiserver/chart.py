"""What the emulated server loads from the chart: the operator's RBAC and the CRDs.

The RBAC comes from `helm template` (the real binary, as tests/charts uses it), so the
grants the tests run under are exactly the ones `helm install` creates.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[3]
CHART = ROOT / "charts" / "cachepoint"
RELEASE, RELEASE_NAMESPACE = "rel", "cachepoint"
OPERATOR_SERVICE_ACCOUNT = f"{RELEASE_NAMESPACE}/{RELEASE}-cachepoint-operator"
RBAC_KINDS = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}


class ChartError(RuntimeError):
    """The chart could not be rendered (no helm, or helm failed)."""


def find_helm() -> str:
    found = shutil.which("helm") or (
        str(ROOT / ".tools/bin/helm") if (ROOT / ".tools/bin/helm").exists() else None
    )
    if found is None:
        raise ChartError("no helm: run `make .tools/bin/helm` (or put helm on PATH)")
    return found


@functools.cache
def rendered_rbac() -> tuple[dict[str, Any], ...]:
    """The chart's Roles, ClusterRoles and their bindings, with default values."""
    result = subprocess.run(
        [find_helm(), "template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode:
        raise ChartError(f"helm template failed:\n{result.stderr}")
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    return tuple(d for d in docs if d.get("kind") in RBAC_KINDS)


def crds(chart: Path = CHART) -> list[dict[str, Any]]:
    """The CRDs as they are on disk now (read at each call: the files may change)."""
    docs = []
    for path in sorted((chart / "crds").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return [d for d in docs if d.get("kind") == "CustomResourceDefinition"]
