"""Run under .venv-vllm by test_events_zmq.py: vLLM's real ZMQ publisher, our consumer.

Each scenario publishes `KVEventBatch`es through vLLM's own `ZmqEventPublisher` (made
by its `EventPublisherFactory` from a `KVEventsConfig`, as vLLM's scheduler makes it)
on the endpoints the replica hands vLLM (`event_endpoints`: ipc sockets, private to
this machine), and consumes them with `events.subscribe` or a whole `VllmCore`.
It only records what happened, as JSON in the file named by argv[1]; the test, in the
main venv, checks it against kvcore's hashing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

B = 4  # tokens per block; vLLM's CPU kernels are not involved, so any size will do
KEYS = ("model:m", "org:zmq")
DEADLINE_S = 5.0  # each wait; the whole script runs in a few seconds past vLLM's import


def tokens(label: int) -> list[int]:
    """A two-block prompt of its own per batch: its first token names the batch."""
    return [label, *range(1000 + 8 * label, 1000 + 8 * label + 2 * B - 1)]


def vllm_hashes(toks: list[int], salt: str | None, parent: bytes = b"seed") -> list[bytes]:
    """Stand-in for vLLM's sha256 chain (bytes, as vLLM's ExternalBlockHash can be)."""
    out = []
    for i in range(len(toks) // B):
        extra = salt.encode() if i == 0 and salt else b""
        block = b"".join(t.to_bytes(4, "big") for t in toks[i * B : (i + 1) * B])
        parent = hashlib.sha256(parent + extra + block).digest()
        out.append(parent)
    return out


class Publisher:
    """vLLM's publisher, and what each batch it published was (the test's expectations)."""

    def __init__(self, name: str, *, buffer_steps: int = 10_000, replay: bool = True) -> None:
        from vllm.config.kv_events import KVEventsConfig
        from vllm.distributed.kv_events import EventPublisherFactory

        from cachepoint.replica.vllm_engine.engine import event_endpoints

        self.endpoints = event_endpoints(name)
        self.pub: Any = EventPublisherFactory.create(
            KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self.endpoints[0],
                replay_endpoint=self.endpoints[1] if replay else None,
                buffer_steps=buffer_steps,
            )
        )
        self.published: list[dict[str, Any]] = []  # one per batch, in sequence order
        self.foreign: dict[int, list[bytes]] = {}  # a stored batch's vLLM hashes

    def store(self, label: int) -> None:
        """A salted root run of two blocks, as vLLM reports a new prompt's blocks."""
        from vllm.distributed.kv_events import BlockStored

        from cachepoint.replica.vllm_engine.scope import encode_salt

        salt = encode_salt(KEYS)
        toks = tokens(label)
        hashes = vllm_hashes(toks, salt)
        self.foreign[label] = hashes
        ev = BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=toks,
            block_size=B,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[(salt,), None],
        )
        self._publish([ev], {"kind": "stored", "label": label, "tokens": toks})

    def extend_and_remove(self, parent: int, label: int, removed: int) -> None:
        """A child run under ``parent``'s last block, and ``removed``'s last block evicted:
        both mean something only after the batches they refer to."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        toks = [label, *range(5000 + 8 * label, 5000 + 8 * label + B - 1)]
        child = vllm_hashes(toks, None, parent=self.foreign[parent][-1])[0]
        events = [
            BlockStored(
                block_hashes=[child],
                parent_block_hash=self.foreign[parent][-1],
                token_ids=toks,
                block_size=B,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None],
            ),
            BlockRemoved(block_hashes=[self.foreign[removed][-1]], medium="GPU"),
        ]
        info = {"kind": "extend_remove", "label": label, "parent": parent, "removed": removed}
        self._publish(events, {**info, "tokens": toks})

    def _publish(self, events: list[Any], info: dict[str, Any]) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.published.append(info)
        self.pub.publish(KVEventBatch(ts=time.time(), events=events))

    async def sent(self, n: int) -> None:
        """Until the publisher thread has sent (and buffered for replay) ``n`` batches."""
        # NOTE: its private buffer is the only sign of that; a subscriber that does not
        # exist yet cannot have received any of them live.
        buffer = self.pub._buffer  # (seq, payload), newest last
        await until(lambda: bool(buffer) and buffer[-1][0] >= n - 1, f"{n} batches sent")

    def close(self) -> None:
        self.pub.shutdown()
        for endpoint in self.endpoints:
            Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


class Consumer:
    """`subscribe` into a PoolMirror, recording each batch as it is handed over."""

    def __init__(self) -> None:
        from cachepoint.kvcore.mirror import PoolMirror

        self.mirror = PoolMirror(B)
        self.delivered: list[list[Any]] = []  # per batch: [kind, first token] per event

    async def on_batch(self, batch: list[Any]) -> None:
        from cachepoint.replica.vllm_engine.events import apply

        # NOTE: yields before applying: the order must hold for a consumer that awaits.
        await asyncio.sleep(0)
        self.delivered.append([[type(e).__name__, _first(e)] for e in batch])
        apply(self.mirror, batch)

    def report(self) -> dict[str, Any]:
        return {"delivered": self.delivered, "cached": sorted(h.hex() for h in self.mirror.cached)}


def _first(ev: Any) -> int | None:
    toks = getattr(ev, "token_ids", None)
    return toks[0] if toks else None


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


async def trickle(pub: Publisher, first: int, stop: Any) -> int:
    """Publish a batch every 20 ms until ``stop()``: a late SUB socket misses whatever
    vLLM sends before its subscription lands, and a batch is what makes it notice."""
    label = first
    deadline = time.monotonic() + DEADLINE_S
    while not stop():
        if time.monotonic() > deadline:
            raise TimeoutError("the subscriber never saw a batch")
        pub.store(label)
        label += 1
        await asyncio.sleep(0.02)
    return label


async def subscribed(pub: Publisher, consumer: Consumer, *, replay: bool = True) -> Any:
    from cachepoint.replica.vllm_engine.events import subscribe

    ready = asyncio.Event()
    task = asyncio.create_task(
        subscribe(pub.endpoints[0], pub.endpoints[1] if replay else None, consumer.on_batch,
                  ready=ready)
    )  # fmt: skip
    await asyncio.wait_for(ready.wait(), DEADLINE_S)
    return task


async def stopped(task: Any) -> str | None:
    """Cancel a subscriber still running; the name of what it raised if it had ended."""
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return None
    exc = task.exception()
    return None if exc is None else f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------ scenarios


async def in_order(warnings: Warnings) -> dict[str, Any]:
    """Subscribed, and seen to receive (ZMQ drops what a PUB sends before a subscription
    lands, and nothing says when it has): 30 more stores, then a batch that extends one
    of them and evicts another's last block."""
    pub = Publisher(f"zmq-order-{os.getpid()}")
    consumer = Consumer()
    try:
        task = await subscribed(pub, consumer)
        first = await trickle(pub, 0, lambda: bool(consumer.delivered) or task.done())
        seen = len(warnings.lines)
        for label in range(first, first + 30):
            pub.store(label)
        pub.extend_and_remove(parent=first + 5, label=first + 30, removed=first + 3)
        end = first + 31
        await until(lambda: len(consumer.delivered) >= end or task.done(), f"{end} batches")
        await asyncio.sleep(0.1)  # nothing more (no duplicate) may follow
        return {
            **consumer.report(),
            "published": pub.published,
            "probes": first,
            "warnings": warnings.lines[seen:],
            "error": await stopped(task),
        }
    finally:
        pub.close()


async def late_joiner(warnings: Warnings) -> dict[str, Any]:
    """vLLM has published five batches (its first ones included) before the subscriber
    exists: they are only in the replay buffer."""
    pub = Publisher(f"zmq-late-{os.getpid()}")
    consumer = Consumer()
    try:
        for label in range(5):
            pub.store(label)
        await pub.sent(5)
        seen = len(warnings.lines)
        task = await subscribed(pub, consumer)
        end = await trickle(pub, 5, lambda: bool(consumer.delivered) or task.done())
        await until(lambda: len(consumer.delivered) >= end or task.done(), f"{end} batches")
        await asyncio.sleep(0.1)  # nothing more (no duplicate) may follow
        return {
            **consumer.report(),
            "published": pub.published,
            "warnings": warnings.lines[seen:],
            "error": await stopped(task),
        }
    finally:
        pub.close()


async def lost(warnings: Warnings, *, replay: bool) -> dict[str, Any]:
    """Six batches published before the subscriber exists, and a replay buffer of three
    (or no replay socket at all): the first three are gone for good."""
    name = f"zmq-lost-{'replay' if replay else 'none'}-{os.getpid()}"
    pub = Publisher(name, buffer_steps=3, replay=replay)
    consumer = Consumer()
    try:
        for label in range(6):
            pub.store(label)
        await pub.sent(6)
        task = await subscribed(pub, consumer, replay=replay)
        await trickle(pub, 6, task.done)
        return {**consumer.report(), "published": pub.published, "error": await stopped(task)}
    finally:
        pub.close()


async def resync(warnings: Warnings) -> dict[str, Any]:
    """A whole VllmCore (no engine: only its event path) whose subscriber hits a gap
    vLLM cannot replay: its watch loop resynchronises, and the mirror follows vLLM's
    later batches again."""
    from cachepoint.replica.settings import ReplicaSettings
    from cachepoint.replica.vllm_engine import core
    from cachepoint.replica.vllm_engine.checkpoint import Checkpoint
    from cachepoint.replica.vllm_engine.core import VllmCore

    core.WATCH_INTERVAL_S = 0.02  # the watch loop's tick, not what it does on one
    name = f"zmq-resync-{os.getpid()}"
    pub = Publisher(name, buffer_steps=3)
    settings = ReplicaSettings(engine="vllm", name=name, block_size=B)
    checkpoint = Checkpoint(
        folder=Path("."), tokenizer=None, eos_ids=frozenset({0}), eos_id=0,  # type: ignore[arg-type]
        vocab_size=10_000, random=False,
    )  # fmt: skip
    sched = VllmCore(settings, checkpoint)
    try:
        for label in range(6):
            pub.store(label)
        await pub.sent(6)
        # What _start_engine does once vLLM is up: subscribe, then watch.
        ready = asyncio.Event()
        sched._events_task = asyncio.create_task(sched._events(pub.endpoints, ready))
        await asyncio.wait_for(ready.wait(), DEADLINE_S)
        epochs = [sched.epoch]
        sched.start()
        label = 6
        resynced_at: int | None = None
        deadline = time.monotonic() + DEADLINE_S
        # A batch every 20 ms until the mirror holds blocks again, and for at least half
        # a second (25 watch ticks) past the first resync: long enough to see a mirror
        # that keeps starting over. Stopped at the deadline either way: the test judges.
        while time.monotonic() < deadline and not (
            resynced_at is not None and label >= resynced_at + 25 and len(sched.mirror)
        ):
            pub.store(label)
            label += 1
            await asyncio.sleep(0.02)
            if sched.epoch != epochs[-1]:
                epochs.append(sched.epoch)
                resynced_at = resynced_at if resynced_at is not None else label
        await asyncio.sleep(0.2)
        if sched.epoch != epochs[-1]:
            epochs.append(sched.epoch)
        return {
            "published": pub.published,
            "epochs": len(epochs),
            "resync_warnings": [w for w in warnings.lines if "mirror starts over" in w],
            "cached": sorted(h.hex() for h in sched.mirror.cached),
            "events_failed": repr(sched._events_failed) if sched._events_failed else None,
            "alive": sched._events_task is not None and not sched._events_task.done(),
        }
    finally:
        for task in (sched._watch_task, sched._events_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        pub.close()


async def main(out: Path) -> None:
    import vllm.distributed.kv_events  # noqa: F401 - seconds; not any scenario's time

    warnings = Warnings()
    logging.getLogger("cachepoint.replica.vllm_engine").addHandler(warnings)
    scenarios = {
        "in_order": in_order,
        "late_joiner": late_joiner,
        "lost_from_buffer": lambda w: lost(w, replay=True),
        "lost_no_replay": lambda w: lost(w, replay=False),
        "resync": resync,
    }
    result: dict[str, Any] = {}
    for name, scenario in scenarios.items():
        t0 = time.monotonic()
        result[name] = await scenario(warnings)
        result[name]["seconds"] = time.monotonic() - t0
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
