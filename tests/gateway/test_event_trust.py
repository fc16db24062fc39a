"""Which URL a replica may announce (gateway/fleet/trust.py) and how the CLI and settings
name replicas."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cachepoint.gateway.cli import split_replicas
from cachepoint.gateway.fleet.trust import UrlPolicy, k8s_dns_name
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.replica.settings import ReplicaSettings


@pytest.mark.parametrize(
    ("url", "name"),
    [
        ("http://big-0.big.prod.svc.cluster.local:8100", "prod_big-0"),
        ("https://big-12.big.team-a.svc:443/", "team-a_big-12"),
        ("http://big-0.big.prod.svc", "prod_big-0"),
        ("http://10.0.0.1:8100", None),
        ("http://big-0.big.prod.svc.evil.example:8100", None),
        ("http://big-0.big.prod.svc.cluster.local:8100/v1/generate", None),
        ("http://user@big-0.big.prod.svc:8100", None),
        ("ftp://big-0.big.prod.svc", None),
    ],
)
def test_k8s_dns_name(url, name):
    assert k8s_dns_name(url) == name


def test_url_policy_rules():
    exact = UrlPolicy("exact", {"a": "http://h:1"})
    assert exact.refuses("a", "http://h:1") is None
    assert "configured URL" in (exact.refuses("a", "http://h:2") or "")
    assert "not in the configured" in (exact.refuses("b", "http://h:1") or "")
    k8s = UrlPolicy("k8s-dns", {"local": "http://127.0.0.1:9"})
    assert k8s.refuses("local", "http://127.0.0.1:9") is None  # the map still applies
    assert k8s.refuses("ns_p-0", "http://p-0.p.ns.svc:8100") is None
    assert "belongs to replica ns_p-1" in (k8s.refuses("ns_p-0", "http://p-1.p.ns.svc") or "")
    assert UrlPolicy("off").refuses("x", "http://anywhere") is None
    with pytest.raises(ValueError, match="unknown replica URL check"):
        UrlPolicy("dns")


def test_cli_replica_flags_split_named_and_bare():
    bare, named = split_replicas(
        ["http://h:1", "r0=http://127.0.0.1:8100", "http://h:2/?a=b", "r1=https://x"]
    )
    assert bare == ["http://h:1", "http://h:2/?a=b"]
    assert named == {"r0": "http://127.0.0.1:8100", "r1": "https://x"}


def test_settings_resolve_the_url_check_and_pair_credentials(monkeypatch):
    assert GatewaySettings().url_check == "off"
    assert GatewaySettings(replicas={"r0": "http://h:1"}).url_check == "exact"
    assert GatewaySettings(replica_url_check="k8s-dns").url_check == "k8s-dns"
    monkeypatch.setenv("CACHEPOINT_NATS_USER", "gateway")
    monkeypatch.setenv("CACHEPOINT_NATS_PASSWORD", "pw")
    s = GatewaySettings()
    assert s.nats_user == "gateway" and s.nats_password.get_secret_value() == "pw"
    monkeypatch.delenv("CACHEPOINT_NATS_PASSWORD")
    with pytest.raises(ValidationError, match="set both or neither"):
        GatewaySettings()
    monkeypatch.delenv("CACHEPOINT_NATS_USER")
    with pytest.raises(ValidationError, match="needs the replicas"):
        GatewaySettings(replica_url_check="exact")
    with pytest.raises(ValidationError, match="not an http"):
        GatewaySettings(replicas={"r0": "10.0.0.1:8100"})


def test_generic_env_names_never_override_the_fleet_credentials(monkeypatch):
    # NATS_USER and friends belong to other tools (the nats CLI); only CACHEPOINT_* count.
    for name in ("NATS_USER", "NATS_PASSWORD", "NATS_URL", "INTERNAL_TOKEN"):
        monkeypatch.setenv(name, "foreign")
    monkeypatch.setenv("CACHEPOINT_NATS_USER", "gateway")
    monkeypatch.setenv("CACHEPOINT_NATS_PASSWORD", "pw")
    for cls in (GatewaySettings, ReplicaSettings):
        s = cls()
        assert (s.nats_user, s.nats_password.get_secret_value()) == ("gateway", "pw")
        assert s.nats_url is None and s.internal_token is None
        # Keyword arguments still name the fields directly.
        assert cls(internal_token="t").internal_token.get_secret_value() == "t"


def test_member_names_cannot_collide_across_namespaces():
    from cachepoint.operator.naming import replica_process_name

    # With "-" both were "team-a-x-0": one member would take the other's NATS user.
    a, b = replica_process_name("team-a", "x-0"), replica_process_name("team", "a-x-0")
    assert a != b
    assert k8s_dns_name("http://x-0.x.team-a.svc:8100") == a
    assert k8s_dns_name("http://a-x-0.a-x.team.svc:8100") == b
