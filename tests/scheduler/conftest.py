from __future__ import annotations

import pytest

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.kvcore import KVEvent
from cachepoint.scheduler.settings import ReplicaSettings


class RecordingSink:
    """Keeps every published event batch, in order."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[KVEvent]]] = []

    def publish(self, epoch: int, events: list[KVEvent]) -> None:
        self.batches.append((epoch, list(events)))

    @property
    def events(self) -> list[KVEvent]:
        return [e for _, batch in self.batches for e in batch]


@pytest.fixture(scope="session")
def engine() -> Engine:
    # 4 layers so fault injection has several layers to pick from; 256 blocks of 16.
    cfg = ModelConfig.tiny(num_layers=4)
    kv = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.hidden_size // cfg.num_heads) * 4
    return Engine(cfg, EngineConfig(kv_cache_bytes=256 * kv, max_model_len=2048), seed=1)


@pytest.fixture
def settings() -> ReplicaSettings:
    return ReplicaSettings(name="r-test", max_num_batched_tokens=256, max_waiting=8)


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()
