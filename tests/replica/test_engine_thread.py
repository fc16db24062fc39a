"""Every piece of a replica's torch work runs on one thread: the engine's build, its
steps and the sampling of their tokens (the host work per step).

torch keeps an OpenMP team per thread that runs a parallel op; once a process's OpenMP
threads outnumber its cores, libgomp stops spinning between parallel regions, and a
tiny decode step measured twice as long (loop.engine_executor). These tests pin
the arrangement down, and what a sampling failure still means for the batch.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from cachepoint.engine import Engine
from cachepoint.protocol import GenerateRequest
from cachepoint.replica import loop as loop_module
from cachepoint.replica.api import app as app_module
from cachepoint.replica.api.app import create_app
from cachepoint.replica.errors import RequestFailedError
from cachepoint.replica.loop import TorchCore
from cachepoint.replica.settings import ReplicaSettings

WAIT_S = 30


def test_the_replica_builds_steps_and_samples_on_one_thread(serve, monkeypatch) -> None:
    seen: dict[str, set[int]] = {"build": set(), "step": set(), "sample": set()}
    build, step, sample = app_module.build_engine, Engine.step, loop_module.sample_each

    def record(what, fn):
        def wrapper(*args, **kwargs):
            seen[what].add(threading.get_ident())
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(app_module, "build_engine", record("build", build))
    monkeypatch.setattr(Engine, "step", record("step", step))
    monkeypatch.setattr(loop_module, "sample_each", record("sample", sample))
    settings = ReplicaSettings(name="r-one-thread", device="cpu", kv_cache_bytes=8 * 2**20)
    url = serve(create_app(settings))
    r = httpx.post(f"{url}/v1/generate", json={"token_ids": [5] * 40, "max_tokens": 6}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_tokens"] >= 1
    # One thread for all three, and not the event loop's (that serves HTTP meanwhile).
    assert seen["build"] == seen["step"] == seen["sample"]
    assert len(seen["build"]) == 1 and threading.main_thread().ident not in seen["build"]


@pytest.fixture
async def sched(engine: Engine, settings, sink):
    s = TorchCore(engine, settings, sink=sink)
    s.start()
    yield s
    await s.stop()


async def test_a_batch_whose_sampling_raises_fails_its_sampled_rows_only(
    sched: TorchCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampling runs on the engine thread after the forward: its failure is the sampled
    rows' (500 api_error), not the forward's, and the loop goes on."""
    sample = loop_module.sample_each
    armed = {"on": True}

    def broken(logits, params, generators):
        if armed["on"]:
            armed["on"] = False
            raise RuntimeError("injected sampling failure")
        return sample(logits, params, generators)

    monkeypatch.setattr(loop_module, "sample_each", broken)
    seq = sched.submit(GenerateRequest(token_ids=[7] * 40, max_tokens=4, ignore_eos=True))
    await asyncio.wait_for(asyncio.wait({seq.done}), WAIT_S)
    with pytest.raises(RequestFailedError, match="injected sampling failure") as err:
        seq.done.result()
    assert err.value.status == 500
    assert sched.alive
    again = sched.submit(GenerateRequest(token_ids=[7] * 40, max_tokens=4, ignore_eos=True))
    await asyncio.wait_for(asyncio.shield(again.done), WAIT_S)
    assert sched.result(again).output_tokens == 4
    # The failed request's prefill was committed before its token failed: the retry hit.
    assert sched.result(again).cache.engine_hit_tokens > 0
    sched.pool.check_invariants()
    assert all(b.ref_cnt == 0 for b in sched.pool.blocks)


async def test_a_given_engine_thread_is_used_and_left_to_its_owner(
    engine: Engine, settings, sink
) -> None:
    thread = loop_module.engine_executor("owned")
    ident = thread.submit(threading.get_ident).result()
    seen: set[int] = set()
    step = engine.step

    def spy(*args, **kwargs):
        seen.add(threading.get_ident())
        return step(*args, **kwargs)

    engine.step = spy  # type: ignore[method-assign]
    try:
        s = TorchCore(engine, settings, sink=sink, engine_thread=thread)
        s.start()
        seq = s.submit(GenerateRequest(token_ids=[9] * 20, max_tokens=2, ignore_eos=True))
        await asyncio.wait_for(asyncio.shield(seq.done), WAIT_S)
        await s.stop()
    finally:
        del engine.step
    assert seen == {ident}
    # Still usable: the scheduler did not shut down an executor it was handed.
    assert thread.submit(lambda: 1).result() == 1
    thread.shutdown()
