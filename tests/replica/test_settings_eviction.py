"""The replica's eviction setting: validated by name, and the pool it builds uses it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from cachepoint.engine import Engine
from cachepoint.kvcore import EVICTION_POLICIES
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.settings import DEFAULT_EVICTION, ReplicaSettings


def test_default_eviction_is_a_registered_strategy():
    assert DEFAULT_EVICTION in EVICTION_POLICIES
    assert ReplicaSettings().eviction == DEFAULT_EVICTION


def test_eviction_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CACHEPOINT_REPLICA_EVICTION", "slru")
    assert ReplicaSettings().eviction == "slru"


def test_unknown_eviction_is_a_clear_error():
    with pytest.raises(ValidationError, match="unknown eviction strategy 'mru'; choose from lru"):
        ReplicaSettings(eviction="mru")


@pytest.mark.parametrize("name", sorted(EVICTION_POLICIES))
def test_the_scheduler_pool_uses_the_configured_eviction(engine: Engine, name: str):
    sched = TorchCore(engine, ReplicaSettings(name="r-ev", eviction=name))
    assert sched.pool.eviction.name == name
    sched.pool.check_invariants()


def test_cli_rejects_an_unknown_eviction():
    r = subprocess.run(
        [sys.executable, "-m", "cachepoint.replica.cli", "--eviction", "mru"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "--eviction" in r.stderr
    assert "Traceback" not in r.stderr
