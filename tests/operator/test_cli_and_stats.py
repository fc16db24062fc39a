"""The operator's command line, its env settings, and the stats client over real HTTP."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cachepoint.bench.kube.cluster import INTERNAL_TOKEN, StatsServer
from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.main import parse_args
from cachepoint.operator.stats import ReplicaStats, poll, stats_url


def test_help_runs_without_a_cluster() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cachepoint.operator.main", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "--all-namespaces" in result.stdout
    assert "--namespace" in result.stdout


def test_scope_flags() -> None:
    options = parse_args(["-n", "a", "--namespace", "b", "--verbose"])
    assert (options.namespaces, options.clusterwide, options.verbose) == (["a", "b"], False, True)
    options = parse_args(["-A", "--liveness", "http://0.0.0.0:8080/healthz"])
    assert (options.clusterwide, options.standalone) == (True, True)
    assert options.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    assert parse_args(["-A", "--peering", "cachepoint"]).standalone is False
    with pytest.raises(SystemExit):
        parse_args([])  # a scope is required: never watch everything by accident
    with pytest.raises(SystemExit):
        parse_args(["-A", "-n", "a"])


def test_config_from_env() -> None:
    env = {
        "CACHEPOINT_OPERATOR_NATS_URL": "nats://n:4222",
        "CACHEPOINT_OPERATOR_STATS_INTERVAL": "2.5",
        "UNRELATED": "x",
    }
    config = OperatorConfig.from_env(env)
    assert (config.nats_url, config.stats_interval, config.otlp_endpoint) == (
        "nats://n:4222",
        2.5,
        None,
    )


def test_stats_url_brackets_ipv6() -> None:
    assert stats_url("10.1.2.3", 8100) == "http://10.1.2.3:8100/v1/stats"
    assert stats_url("fd00::5", 8100) == "http://[fd00::5]:8100/v1/stats"


async def test_poll_reads_members_and_reports_failures(stats_server: StatsServer) -> None:
    urls = {
        "r-0": stats_url("127.0.0.1", stats_server.port),
        "r-1": f"http://127.0.0.1:{stats_server.port}/nothing-here",
    }
    results = await poll(urls, timeout=2.0, token=INTERNAL_TOKEN)
    assert isinstance(results["r-0"], ReplicaStats)
    assert results["r-0"].epoch == 1
    assert results["r-0"].blocks.cached_free == 300
    assert isinstance(results["r-1"], str)
    assert "404" in results["r-1"]


async def test_poll_sends_the_internal_token(stats_server: StatsServer) -> None:
    urls = {"r-0": stats_url("127.0.0.1", stats_server.port)}
    without = await poll(urls, timeout=2.0)
    assert isinstance(without["r-0"], str)
    assert "401" in without["r-0"]
    assert isinstance((await poll(urls, timeout=2.0, token="wrong"))["r-0"], str)
    assert isinstance((await poll(urls, timeout=2.0, token=INTERNAL_TOKEN))["r-0"], ReplicaStats)


def test_peering_instances_never_tie_on_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf pauses every instance that ties the highest priority: two operator replicas
    with one default priority would both stand by, so each draws its own."""
    import kopf

    from cachepoint.operator import main as operator_main

    drawn = {parse_args(["-A", "--peering", "cp"]).priority for _ in range(20)}
    assert len(drawn) > 1 and all(1 <= p <= 32767 for p in drawn)
    assert parse_args(["-A", "--peering", "cp", "--priority", "7"]).priority == 7
    assert parse_args(["-A"]).priority == 0  # standalone: no peering, no priority
    with pytest.raises(SystemExit):
        parse_args(["-A", "--priority", "7"])
    seen: dict[str, object] = {}
    monkeypatch.setattr(kopf, "run", lambda **kw: seen.update(kw))
    monkeypatch.setattr(kopf, "configure", lambda **kw: None)
    assert operator_main.main(["-A", "--peering", "cp", "--priority", "5"]) == 0
    assert seen["priority"] == 5 and seen["peering_name"] == "cp" and seen["standalone"] is False
