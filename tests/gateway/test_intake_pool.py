"""The intake pool (gateway/intake/pool.py): one org cannot take every worker, its
queue is bounded, and hanging up does not give its slot back early."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cachepoint.gateway.intake import IntakeFull, IntakePool


def blocker(gate: threading.Event, started: list[str], name: str) -> str:
    started.append(name)
    gate.wait(10)
    return name


def test_one_org_holds_at_most_its_share_and_others_still_run():
    async def main() -> None:
        pool = IntakePool(workers=3, org_share=2, org_bytes=2**20)
        gate = threading.Event()
        started: list[str] = []
        a_jobs = [
            asyncio.create_task(pool.run("org-a", blocker, gate, started, f"a{i}"))
            for i in range(5)
        ]
        await asyncio.sleep(0.2)
        assert sorted(started) == ["a0", "a1"]  # its share, not every worker
        t0 = time.perf_counter()
        assert await pool.run("org-b", lambda: "b") == "b"
        assert time.perf_counter() - t0 < 1.0
        gate.set()
        assert sorted(await asyncio.gather(*a_jobs)) == [f"a{i}" for i in range(5)]
        pool.shutdown()

    asyncio.run(main())


def test_admission_is_bounded_per_org_by_declared_bytes():
    async def main() -> None:
        pool = IntakePool(workers=2, org_share=1, org_bytes=100)
        held = []
        for n in (60, 30, 10):
            cm = pool.admitted("org-a", n)
            await cm.__aenter__()
            held.append(cm)
        with pytest.raises(IntakeFull):
            async with pool.admitted("org-a", 1):
                pass
        async with pool.admitted("org-b", 500):  # another org, and its first: let in
            pass
        await held.pop().__aexit__(None, None, None)
        async with pool.admitted("org-a", 10):  # room came free
            pass
        for cm in held:
            await cm.__aexit__(None, None, None)
        assert pool._orgs == {}  # idle orgs are forgotten

    asyncio.run(main())


def test_a_cancelled_running_job_keeps_its_slot_until_it_ends():
    async def main() -> None:
        pool = IntakePool(workers=3, org_share=1, org_bytes=2**20)
        gate = threading.Event()
        started: list[str] = []
        first = asyncio.create_task(pool.run("org-a", blocker, gate, started, "a0"))
        await asyncio.sleep(0.1)
        first.cancel()  # the client hung up; the thread still works
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.create_task(pool.run("org-a", blocker, gate, started, "a1"))
        await asyncio.sleep(0.2)
        assert started == ["a0"]  # a1 waits: a0 still holds the org's one slot
        gate.set()
        assert await second == "a1"
        pool.shutdown()

    asyncio.run(main())


def test_a_cancelled_waiting_job_never_runs():
    async def main() -> None:
        pool = IntakePool(workers=1, org_share=1, org_bytes=2**20)
        gate = threading.Event()
        started: list[str] = []
        first = asyncio.create_task(pool.run("org-a", blocker, gate, started, "a0"))
        waiting = asyncio.create_task(pool.run("org-b", blocker, gate, started, "b0"))
        await asyncio.sleep(0.1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.set()
        assert await first == "a0"
        await asyncio.sleep(0.1)
        assert started == ["a0"]
        pool.shutdown()

    asyncio.run(main())


def test_jobs_see_the_callers_context_and_raise_in_it():
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")

    def read() -> str:
        return var.get()

    def fail() -> None:
        raise ValueError("boom")

    async def main() -> None:
        pool = IntakePool(workers=2, org_share=1, org_bytes=2**20)
        var.set("caller")
        assert await pool.run("o", read) == "caller"
        with pytest.raises(ValueError, match="boom"):
            await pool.run("o", fail)
        pool.shutdown()

    asyncio.run(main())


def test_a_small_body_runs_on_the_loop_and_a_larger_one_in_a_worker():
    async def main() -> None:
        pool = IntakePool(workers=2, org_share=1, org_bytes=2**20, inline_bytes=1024)
        loop_thread = threading.get_ident()

        def where() -> int:
            return threading.get_ident()

        assert await pool.run("org-a", where, size=1024) == loop_thread
        assert await pool.run("org-a", where, size=1025) != loop_thread
        assert await pool.run("org-a", where) != loop_thread  # no size: always a worker
        with pytest.raises(ValueError, match="bad body"):  # its errors raise as before
            await pool.run("org-a", lambda: int("bad body"), size=10)
        assert pool._orgs == {}  # an inline job takes no slot
        pool.shutdown()

    asyncio.run(main())
