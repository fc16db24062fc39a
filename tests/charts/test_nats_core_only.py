"""Builtin NATS: core NATS only (no JetStream, no volume), monitor port for scrapers only.

The event plane publishes, subscribes and answers requests; nothing in services/,
gateway/ or operator/ opens a JetStream context, and no user may touch $JS.API.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from cachepoint.operator.nats_auth import GATEWAY_PERMISSIONS, replica_permissions

from .conftest import RELEASE, ROOT, render
from .test_chart import objects, one

FULLNAME = f"{RELEASE}-cachepoint"


def test_nothing_uses_jetstream() -> None:
    uses = re.compile(r"\.jetstream\(|JetStreamContext|\$JS\.")
    found = [
        str(path.relative_to(ROOT))
        for folder in ("services", "gateway", "operator")
        for path in (ROOT / folder).rglob("*.py")
        if uses.search(path.read_text())
    ]
    assert found == []
    subjects = str(GATEWAY_PERMISSIONS) + str(replica_permissions("ns_pod-0"))
    assert "$JS" not in subjects


def test_builtin_nats_runs_without_jetstream_or_volume(helm: str) -> None:
    docs = render(helm, "default")
    nats = one(docs, "StatefulSet", f"{FULLNAME}-nats")
    assert "volumeClaimTemplates" not in nats["spec"]
    server = nats["spec"]["template"]["spec"]["containers"][0]
    assert not [a for a in server["args"] if "jetstream" in a or "store_dir" in a]
    assert "data" not in {m["name"] for m in server["volumeMounts"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert server[probe]["httpGet"]["path"] == "/healthz", probe  # no js-* options
    conf = one(docs, "ConfigMap", f"{FULLNAME}-nats")["data"]["nats.conf"]
    assert not re.search(r"^\s*jetstream", conf, re.MULTILINE)


def test_jetstream_values_are_gone(helm: str) -> None:
    with pytest.raises(AssertionError, match="jetstream"):
        render(helm, "default", "--set", "nats.jetstream.enabled=true")
    values = yaml.safe_load((ROOT / "charts/cachepoint/values.yaml").read_text())
    assert "jetstream" not in values["nats"]


def _monitor_peers(docs: list[dict]) -> list[list[dict]]:
    policy = one(docs, "NetworkPolicy", f"{FULLNAME}-nats")
    return [
        rule.get("from", [])
        for rule in policy["spec"]["ingress"]
        if any(p["port"] == "monitor" for p in rule["ports"])
    ]


def test_nats_monitor_port_only_for_scrapers(helm: str) -> None:
    # It has no login and lists every connection: not for every pod of the namespace.
    assert _monitor_peers(render(helm, "default")) == [
        [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    ]
    assert (
        _monitor_peers(render(helm, "default", "--set-json", "networkPolicy.metricsFrom=[]")) == []
    )


def test_no_nats_policy_or_server_in_external_mode(helm: str) -> None:
    docs = render(
        helm, "default", "--set", "nats.mode=external", "--set", "nats.url=nats://n.m:4222"
    )
    assert f"{FULLNAME}-nats" not in objects(docs, "NetworkPolicy")
    assert f"{FULLNAME}-nats" not in objects(docs, "StatefulSet")


def test_docs_do_not_promise_jetstream() -> None:
    text = Path(ROOT / "docs/deploy.md").read_text()
    assert "with JetStream and a login" not in text
