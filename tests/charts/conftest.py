"""Render the chart with the real helm binary (on PATH, or fetched into .tools/bin)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "cachepoint"
KUBE_VERSION = "1.31.0"
RELEASE, NAMESPACE = "rel", "cachepoint"
SCENARIOS = ["default", *sorted(p.stem for p in (CHART / "ci").glob("*-values.yaml"))]


def find_helm() -> str:
    found = shutil.which("helm") or (
        str(ROOT / ".tools/bin/helm") if (ROOT / ".tools/bin/helm").exists() else None
    )
    if found is None:
        pytest.fail("no helm: run `make .tools/bin/helm` (or put helm on PATH)")
    return found


@pytest.fixture(scope="session")
def helm() -> str:
    return find_helm()


def run_helm(helm: str, *args: str | Path, chart: Path = CHART) -> str:
    result = subprocess.run(
        [helm, *map(str, args)], capture_output=True, text=True, timeout=60, cwd=chart.parent
    )
    if result.returncode:
        raise AssertionError(f"helm {' '.join(map(str, args))} failed:\n{result.stderr}")
    return result.stdout


def values_args(scenario: str) -> list[str | Path]:
    return [] if scenario == "default" else ["-f", CHART / "ci" / f"{scenario}.yaml"]


def render(helm: str, scenario: str, *extra: str, chart: Path = CHART) -> list[dict[str, Any]]:
    """Every object `helm install` would create, CRDs included, as dicts."""
    out = run_helm(
        helm,
        "template",
        RELEASE,
        chart,
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSION,
        "--include-crds",
        *values_args(scenario),
        *extra,
        chart=chart,
    )
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="session")
def rendered(helm: str) -> dict[str, list[dict[str, Any]]]:
    return {scenario: render(helm, scenario) for scenario in SCENARIOS}
