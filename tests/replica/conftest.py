from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.kvcore import KVEvent
from cachepoint.replica.settings import ReplicaSettings


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


def wait_ready(url: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    """Until a replica process answers /readyz 200; its output if it exits first."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(f"{url}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"replica exited with {proc.returncode}: {out or ''}{err or ''}")
        assert time.time() < deadline, "replica never became ready"
        time.sleep(0.2)


SMALL_LEN = 256  # max_model_len of the small engine
SMALL_BLOCKS = 16  # its pool: exactly one max_model_len sequence of 16-token blocks


@pytest.fixture(scope="module")
def small_engine() -> Engine:
    cfg = ModelConfig.tiny()
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * (cfg.hidden_size // cfg.num_heads) * 4
    eng = Engine(
        cfg,
        EngineConfig(kv_cache_bytes=SMALL_BLOCKS * per_block, max_model_len=SMALL_LEN),
        seed=3,
    )
    assert eng.num_blocks == SMALL_BLOCKS
    return eng
