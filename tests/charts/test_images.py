"""Static checks of the Dockerfiles and skaffold.yaml (no Docker engine here to build)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import CHART, ROOT

DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
# Upstream images the project may build on; each pinned to an exact version tag.
ALLOWED_BASES = {
    "python": r"3\.11\.\d+-slim-\w+",
    "pytorch/pytorch": r"\d+\.\d+\.\d+-cuda[\d.]+-cudnn9-runtime",
}


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())  # join continuation lines
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            result.append((op.upper(), rest.strip()))
    return result


def resolve(image: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


def test_the_four_images_exist() -> None:
    names = {p.name for p in DOCKERFILES}
    assert names == {
        "gateway.Dockerfile",
        "operator.Dockerfile",
        "replica-cpu.Dockerfile",
        "replica-cuda.Dockerfile",
    }


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_pinned_non_root(dockerfile: Path) -> None:
    steps = instructions(dockerfile)
    args = {}
    for op, rest in steps:
        if op == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            args[key] = value
    bases = [resolve(rest.split()[0], args) for op, rest in steps if op == "FROM"]
    assert len(bases) >= 2, "multi-stage: a build stage and a run stage"
    for base in bases:
        repo, _, tag = base.partition(":")
        assert repo in ALLOWED_BASES, base
        assert re.fullmatch(ALLOWED_BASES[repo], tag), f"{base}: pin an exact version tag"
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    users = [rest for op, rest in final if op == "USER"]
    assert users, "the run stage must switch user"
    assert re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", users[-1]), "numeric non-root uid (runAsNonRoot)"
    pins = [rest for op, rest in steps if op == "RUN" and "pip install pip==" in rest]
    assert pins, "pip itself is pinned"
    installs = [
        rest for op, rest in steps if op == "RUN" and re.search(r"pip install .*\s\"?\.", rest)
    ]
    assert installs
    assert all("--constraint docker/constraints.txt" in r for r in installs)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copies_exist_and_the_ignore_file_lets_them_in(dockerfile: Path) -> None:
    ignore = Path(f"{dockerfile}.dockerignore").read_text().split()
    for op, rest in instructions(dockerfile):
        if op != "COPY" or rest.startswith("--from"):
            continue
        for source in rest.split()[:-1]:
            assert (ROOT / source).exists(), source
            assert f"!{source}" in ignore or f"!{source}/" in ignore, source


def test_constraints_pin_everything_but_torch() -> None:
    lines = [
        line
        for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert len(lines) > 20
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9._-]*==[\w.+-]+", line) for line in lines)
    names = {line.split("==")[0] for line in lines}
    assert {"kopf", "fastapi", "httpx", "sqlalchemy"} <= names
    assert not any(name.startswith(("torch", "nvidia-")) for name in names)


def skaffold() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "skaffold.yaml").read_text())


def releases_and_artifacts(config: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    return config["deploy"]["helm"]["releases"], config["build"]["artifacts"]


@pytest.mark.parametrize("profile", [None, "cpu", "gpu"])
def test_skaffold_builds_the_images_and_deploys_the_chart(profile: str | None) -> None:
    config = skaffold()
    assert config["apiVersion"].startswith("skaffold/v4")
    if profile:
        (chosen,) = [p for p in config["profiles"] if p["name"] == profile]
        config = {**config, **{k: v for k, v in chosen.items() if k in ("build", "deploy")}}
    releases, artifacts = releases_and_artifacts(config)
    images = {a["image"] for a in artifacts}
    assert {"cachepoint-gateway", "cachepoint-operator"} <= images
    assert images & {"cachepoint-replica-cpu", "cachepoint-replica-cuda"}
    for artifact in artifacts:
        assert (ROOT / artifact["docker"]["dockerfile"]).exists()
    schema = json.loads((CHART / "values.schema.json").read_text())
    (release,) = releases
    assert (ROOT / release["chartPath"]) == CHART
    for values in release["valuesFiles"]:
        assert (ROOT / values).exists()
    for key, template in release["setValueTemplates"].items():
        node = schema
        for part in key.split("."):
            node = node["properties"][part]  # the key exists in the chart's values
        image = re.search(r"IMAGE_(?:REPO|TAG)_(\w+)", template).group(1)
        assert image.replace("_", "-") in images, (key, template)
