"""checkov's skip list (.checkov.yaml) against docs/deploy.md and the Makefile, and the
chart properties that the skipped checks would otherwise have guarded.

checkov itself runs only through `make checkov` (part of `make test`), from its own
venv: its pinned dependencies conflict with the test venv's.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from .conftest import CHART, ROOT, render

CONFIG = ROOT / ".checkov.yaml"
CHECK_ID = r"CKV2?_[A-Z0-9]+_\d+"


def config() -> dict[str, Any]:
    return yaml.safe_load(CONFIG.read_text())


def documented_skips() -> dict[str, str]:
    """Check id -> reason, from the table under "Static checks" in docs/deploy.md."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    start = text.index("\n## Static checks")
    section = text[start : text.index("\n## ", start + 1)]
    found = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.match(rf"`{CHECK_ID}`", cells[0]):
            for check in re.findall(rf"`({CHECK_ID})`", cells[0]):
                found[check] = cells[2]
    return found


def test_every_skip_is_documented_with_its_reason() -> None:
    skips = config()["skip-check"]
    assert len(skips) == len(set(skips))
    assert all(re.fullmatch(CHECK_ID, check) for check in skips)
    documented = documented_skips()
    assert sorted(documented) == sorted(skips)
    for check, reason in documented.items():
        assert len(reason.split()) >= 8, f"{check}: say why it stays"


def test_every_skip_has_a_comment_in_the_config() -> None:
    lines = CONFIG.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(rf"\s*- {CHECK_ID}", line):
            j = i - 1
            while re.fullmatch(rf"\s*- {CHECK_ID}", lines[j]):
                j -= 1  # a group of checks shares one comment
            assert lines[j].strip().startswith("#"), line


def test_config_fails_on_findings_and_scans_both_frameworks() -> None:
    cfg = config()
    assert sorted(cfg["framework"]) == ["dockerfile", "github_actions", "kubernetes"]
    assert not {"soft-fail", "soft-fail-on", "hard-fail-on", "check"} & set(cfg)
    assert cfg["skip-download"] is True  # no network in CI


def test_make_test_runs_checkov_with_this_config() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:.*\bcheckov\b", makefile, re.M)
    recipe = re.search(r"^checkov:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe
    body = recipe.group(1)
    assert "$(HELM) template" in body
    assert "-f charts/cachepoint/ci/tracing-values.yaml" in body
    scan = r"^\t\$\(CHECKOV\) --config-file \.checkov\.yaml -d \S+ -d docker -d \.github$"
    assert re.search(scan, body, re.M)
    assert "CHECKOV_PIN  := checkov==3.3.30" in makefile
    assert ".venv-checkov/" in (ROOT / ".gitignore").read_text().splitlines()


# ---- what the skipped checks would have guarded, checked here instead


@pytest.fixture(scope="module")
def docs(helm: str) -> list[dict[str, Any]]:
    """The two renderings `make checkov` scans."""
    return [
        *render(helm, "default"),
        *render(helm, "default", "-f", str(CHART / "ci" / "tracing-values.yaml")),
    ]


def pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pod specs of the long-running workloads, by kind/name."""
    return {
        f"{d['kind']}/{d['metadata']['name']}": d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
    }


def test_long_running_containers_have_both_probes(docs: list[dict[str, Any]]) -> None:
    # CKV_K8S_8/9 are skipped for the helm test pod and the NATS reloader only.
    checked = set()
    for where, pod in pods(docs).items():
        for container in pod["containers"]:
            if where.endswith("-nats") and container["name"] == "reloader":
                continue
            assert "livenessProbe" in container, (where, container["name"])
            assert "readinessProbe" in container, (where, container["name"])
            checked.add(where.split("-", 1)[1].rsplit("-", 1)[-1])
    assert {"operator", "gateway", "nats", "postgresql", "collector", "jaeger"} <= checked


def test_the_operator_has_a_readiness_probe(docs: list[dict[str, Any]]) -> None:
    # Fixed checkov finding (CKV_K8S_9): a rolling update waits for kopf's /healthz.
    operator = pods(docs)["Deployment/rel-cachepoint-operator"]["containers"][0]
    assert operator["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_only_postgresql_runs_below_uid_10000(docs: list[dict[str, Any]]) -> None:
    # CKV_K8S_40 is skipped for the builtin PostgreSQL only; NATS moved to 10001.
    for where, pod in pods(docs).items():
        uids = {pod.get("securityContext", {}).get("runAsUser")}
        uids |= {c.get("securityContext", {}).get("runAsUser") for c in pod["containers"]}
        uids.discard(None)
        if where.endswith("-postgresql"):
            assert uids == {70}
        else:
            assert all(uid >= 10000 for uid in uids), (where, uids)
    nats = pods(docs)["StatefulSet/rel-cachepoint-nats"]["securityContext"]
    assert (nats["runAsUser"], nats["runAsGroup"], nats["fsGroup"]) == (10001, 10001, 10001)


def test_every_container_has_a_read_only_root(docs: list[dict[str, Any]]) -> None:
    # Fixed checkov finding (CKV_K8S_22) for PostgreSQL: its writable paths are volumes.
    for where, pod in pods(docs).items():
        for container in pod["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, where
    postgres = pods(docs)["StatefulSet/rel-cachepoint-postgresql"]
    mounts = {m["mountPath"] for m in postgres["containers"][0]["volumeMounts"]}
    assert {"/var/lib/postgresql/data", "/var/run/postgresql", "/tmp"} <= mounts
    empty_dirs = {v["name"] for v in postgres["volumes"] if "emptyDir" in v}
    assert {"run", "tmp"} <= empty_dirs


def test_only_the_operator_mounts_a_service_account_token(docs: list[dict[str, Any]]) -> None:
    # CKV_K8S_38 is skipped for the operator, the one pod that calls the API server.
    for where, pod in pods(docs).items():
        if where != "Deployment/rel-cachepoint-operator":
            assert pod.get("automountServiceAccountToken") is False, where


def test_every_container_requests_cpu_and_limits_memory(docs: list[dict[str, Any]]) -> None:
    # CKV_K8S_11 (CPU limits) is skipped: a CPU request and a memory limit instead.
    for where, pod in pods(docs).items():
        for container in pod["containers"]:
            resources = container.get("resources", {})
            assert "cpu" in resources.get("requests", {}), (where, container["name"])
            assert "memory" in resources.get("limits", {}), (where, container["name"])
