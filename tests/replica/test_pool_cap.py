"""A scheduler may run on fewer blocks than its engine has (benchmarks on a GPU)."""

from __future__ import annotations

import asyncio

import pytest

from cachepoint.engine import Engine
from cachepoint.protocol import GenerateRequest
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.settings import ReplicaSettings


async def test_num_blocks_caps_the_pool(engine: Engine, sink) -> None:
    least = engine.max_model_len // engine.block_size
    s = TorchCore(engine, ReplicaSettings(name="r-cap"), sink=sink, num_blocks=least)
    assert s.pool.num_blocks == least < engine.num_blocks
    s.start()
    try:
        seq = s.submit(GenerateRequest(token_ids=list(range(1, 40)), max_tokens=4))
        await asyncio.wait_for(seq.done, 30)
    finally:
        await s.stop()
    s.pool.check_invariants()
    assert len(seq.output) == 4


@pytest.mark.parametrize("delta", [-1, "over"])
def test_num_blocks_out_of_range_is_refused(engine: Engine, sink, delta: object) -> None:
    least = engine.max_model_len // engine.block_size
    n = least - 1 if delta == -1 else engine.num_blocks + 1
    with pytest.raises(ValueError, match="num_blocks"):
        TorchCore(engine, ReplicaSettings(name="r-cap"), sink=sink, num_blocks=n)
