"""vLLM's KV events, replayed into a kvcore `PoolMirror`.

vLLM publishes ``KVEventBatch``es on a ZMQ PUB socket (``kv_events_config``): topic,
an 8-byte big-endian sequence number and a msgpack payload. A run of blocks stored
under a parent carries its tokens and, on a first block, the ``cache_salt``: enough
to name every block in kvcore's hash space (`apply`). A gap in the sequence numbers is
filled from vLLM's replay socket; one that cannot be filled means the mirror no longer
knows what vLLM holds, and the caller must resynchronise (clear vLLM's prefix cache).

`apply` reads events by attribute, so the tests drive it without vLLM installed;
`subscribe` needs pyzmq and vLLM's own decoder, and runs in the vLLM environment only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cachepoint.kvcore import BlockHash
from cachepoint.kvcore.mirror import PoolMirror
from cachepoint.replica.vllm_engine.scope import decode_salt

log = logging.getLogger(__name__)

# vLLM names the device pool's medium "GPU" on every platform (the CPU build too);
# a KV connector's lower tiers ("CPU", "STORAGE") are not this pool.
_DEVICE_MEDIA = (None, "GPU")


@dataclass(slots=True)
class ApplyStats:
    """What one batch did to the mirror."""

    stored: int = 0  # blocks newly mirrored
    removed: list[BlockHash] = field(default_factory=list)  # kvcore hashes that left
    cleared: bool = False  # vLLM dropped everything
    skipped: int = 0  # blocks not ours to mirror (another medium, block size or salt)


def apply(mirror: PoolMirror, events: Iterable[Any]) -> ApplyStats:
    """Replay vLLM events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``)."""
    out = ApplyStats()
    for ev in events:
        kind = type(ev).__name__
        if kind == "AllBlocksCleared":
            mirror.cleared()
            out.cleared = True
        elif kind == "BlockRemoved":
            if getattr(ev, "medium", None) in _DEVICE_MEDIA:
                out.removed += mirror.removed(ev.block_hashes)
        elif kind == "BlockStored":
            out.stored += _stored(mirror, ev, out)
        else:
            log.debug("vLLM KV event %s ignored", kind)
    return out


def _stored(mirror: PoolMirror, ev: Any, out: ApplyStats) -> int:
    n = len(ev.block_hashes)
    if getattr(ev, "medium", None) not in _DEVICE_MEDIA or ev.block_size != mirror.block_size:
        out.skipped += n
        return 0
    root_keys: tuple[str, ...] = ()
    if ev.parent_block_hash is None:
        extra = ev.extra_keys[0] if getattr(ev, "extra_keys", None) else None
        keys = decode_salt(extra)
        if keys is None:
            out.skipped += n
            return 0
        root_keys = keys
    return mirror.stored(ev.parent_block_hash, ev.block_hashes, ev.token_ids, root_keys)


class EventGap(RuntimeError):
    """Batches were lost and vLLM could not replay them: the mirror is stale."""


async def subscribe(
    endpoint: str,
    replay_endpoint: str | None,
    on_batch: Callable[[list[Any]], Awaitable[None] | None],
    *,
    ready: asyncio.Event | None = None,
    from_start: bool = True,
) -> None:
    """Receive vLLM's batches in order and hand each one's events to ``on_batch``.

    ``from_start``: the stream from vLLM's first batch (a subscriber that joins as the
    engine starts); otherwise from the first batch received (one that joins a running
    engine after a resync, its mirror started over).

    Raises `EventGap` when a gap could not be filled. Runs until cancelled.
    """
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    ctx = zmq.asyncio.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    # NOTE: vLLM numbers a publisher's batches from 0, and a SUB socket joins late (ZMQ
    # drops what a PUB sends before the subscription lands): starting at -1, a first
    # batch that was missed is a gap to replay like any other. Not after a resync: the
    # history before it is not wanted, and past vLLM's replay buffer it is not there
    # either (asking for it again was one EventGap, and one resync, after another).
    last: int | None = -1 if from_start else None

    async def deliver(payload: bytes) -> None:
        result = on_batch(decoder.decode(payload).events)
        if result is not None:
            await result

    try:
        if ready is not None:
            ready.set()
        while True:
            _topic, seq_bytes, payload = await sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if last is None:
                last = seq - 1
            if seq != last + 1:
                if seq <= last:
                    continue  # a duplicate (already replayed)
                log.warning("vLLM KV events %d..%d missed; replaying", last + 1, seq - 1)
                missed = await _replay(ctx, replay_endpoint, last + 1, seq)
                for payload_missed in missed:
                    await deliver(payload_missed)
            await deliver(payload)
            last = seq
    finally:
        sub.close(linger=0)


async def _replay(ctx: Any, endpoint: str | None, start: int, stop: int) -> list[bytes]:
    """Batches ``start..stop-1`` from vLLM's replay socket, or raise `EventGap`."""
    import zmq

    if endpoint is None:
        raise EventGap(f"batches {start}..{stop - 1} lost and no replay endpoint")
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    got: dict[int, bytes] = {}
    try:
        await req.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            if not await req.poll(timeout=2000):
                break
            _empty, _topic, seq_bytes, payload = await req.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:
                break  # vLLM's end-of-replay marker
            if seq < stop:
                got[seq] = payload
    finally:
        req.close(linger=0)
    wanted = range(start, stop)
    if any(s not in got for s in wanted):
        raise EventGap(f"batches {start}..{stop - 1} lost; vLLM's replay buffer lacks some")
    return [got[s] for s in wanted]
