"""The shipped Grafana dashboard queries only metrics the services really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.gateway.observability.metrics import GatewayMetrics
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.metrics import ReplicaMetrics
from cachepoint.replica.settings import ReplicaSettings

DASHBOARD = Path(__file__).parents[2] / "charts" / "cachepoint" / "dashboards" / "cachepoint.json"


def exported() -> set[str]:
    gw = GatewayMetrics()
    gw.watch_plane(lambda: {"lag_s": 0.0, "resyncs": 0, "heartbeat_misses": 0, "live": 0})
    engine = Engine(ModelConfig.tiny(), EngineConfig(kv_cache_bytes=4 * 2**20, max_model_len=256))
    rep = ReplicaMetrics(TorchCore(engine, ReplicaSettings()))
    names: set[str] = set()
    for registry in (gw.registry, rep.registry):
        for fam in registry.collect():
            # Labelled families have no samples until first used: derive their names.
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
            names.add(fam.name)
            names.update(fam.name + sfx for sfx in suffixes.get(fam.type, ()))
    return names


def test_dashboard_queries_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"cachepoint_[a-z0-9_]+", e)}
    assert len(queried) >= 15
    missing = sorted(queried - exported())
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"


def test_dashboard_matches_its_generator():
    import runpy

    gen = runpy.run_path(str(DASHBOARD.parents[2] / "make_dashboard.py"))
    assert json.loads(DASHBOARD.read_text()) == gen["build"]()
