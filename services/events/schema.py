"""Versioned, compact wire messages (msgspec + msgpack).

A batch names its schema version (``v``); a consumer refuses a version it does not
know rather than misreading it. Hashes travel as raw 16-byte strings.

NOTE: fields added within a version are appended with a default, so both sides of
a rolling upgrade read each other: an array-like struct (`Stored`, `Removed`)
decodes a shorter array with the trailing defaults filled in, and ignores extra
trailing items; a map struct (`Heartbeat`, `Snapshot`) fills missing keys with
their defaults and ignores unknown ones. The KV tiers' fields were added so.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec

from cachepoint.kvcore import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent, Tier

SCHEMA_VERSION = 1


class SchemaError(ValueError):
    """A message this code cannot read: garbage, or an unknown schema version."""


class Stored(msgspec.Struct, tag="stored", array_like=True, frozen=True):
    block_hashes: list[bytes]  # in chain order
    parent_hash: bytes | None  # the block before the run; None at the root (and below device)
    # NOTE: by name ("device", "host", "disk"): an unknown name fails decoding, so the
    # batch is refused (SchemaError) rather than filed under the wrong tier.
    tier: Tier = Tier.DEVICE  # where the blocks became visible for hits; absent in old senders


class Removed(msgspec.Struct, tag="removed", array_like=True, frozen=True):
    block_hashes: list[bytes]
    tier: Tier = Tier.DEVICE  # the tier the blocks left; absent in old senders


class Cleared(msgspec.Struct, tag="cleared", array_like=True, frozen=True):
    pass


Event = Stored | Removed | Cleared


class EventBatch(msgspec.Struct, frozen=True):
    v: int  # schema version
    replica: str
    epoch: int  # new at every replica start
    seq: int  # contiguous per epoch, from 1
    ts: float  # unix seconds when published
    events: list[Event]


class Heartbeat(msgspec.Struct, frozen=True):
    v: int
    name: str
    url: str  # where the replica's HTTP API answers
    epoch: int
    model: str
    block_size: int
    last_seq: int  # the last event batch published in this epoch
    queued_prefill_tokens: int  # prefill work waiting: the router's load term
    running: int
    waiting: int
    max_waiting: int  # at this many waiting the replica answers 429
    blocks_total: int
    blocks_active: int
    blocks_cached_free: int
    blocks_retained: int
    hit_tokens: int
    query_tokens: int
    ts: float
    # The cost model the router prices lower-tier hits with (cachepoint.routing.costs);
    # 0 = not reported, and the router then assumes conservative defaults.
    kv_bytes_per_token: int = 0  # KV bytes of one token that one device copies (its TP shard)
    prefill_tokens_per_s: float = 0.0  # prefill throughput: recompute costs 1/this per token
    host_read_bytes_per_s: float = 0.0  # host memory -> device copy bandwidth, per device
    disk_read_bytes_per_s: float = 0.0  # local disk -> device copy bandwidth, per device
    # NOTE: last, with a default: a heartbeat from an older replica decodes as not draining.
    draining: bool = False  # going away: route nothing new here; what runs there finishes


class Snapshot(msgspec.Struct, frozen=True):
    v: int
    replica: str
    epoch: int
    seq: int  # the index below is exact as of this batch
    block_hashes: list[bytes]  # the device's hashes
    host_hashes: list[bytes] = msgspec.field(default_factory=list)  # held in host memory
    disk_hashes: list[bytes] = msgspec.field(default_factory=list)  # held on local disk


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {
    cls: msgspec.msgpack.Decoder(cls) for cls in (EventBatch, Heartbeat, Snapshot)
}


def encode(msg: EventBatch | Heartbeat | Snapshot) -> bytes:
    return _ENCODER.encode(msg)


M = TypeVar("M", EventBatch, Heartbeat, Snapshot)


def decode(data: bytes, cls: type[M]) -> M:
    try:
        msg: M = _DECODERS[cls].decode(data)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"not a {cls.__name__}: {exc}") from exc
    if msg.v != SCHEMA_VERSION:
        raise SchemaError(f"{cls.__name__} schema v{msg.v}; this build reads v{SCHEMA_VERSION}")
    return msg


def to_wire(events: Iterable[KVEvent]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(Stored(list(e.block_hashes), e.parent_hash, e.tier))
        elif isinstance(e, BlockRemoved):
            out.append(Removed(list(e.block_hashes), e.tier))
        else:
            out.append(Cleared())
    return out


def to_kvcore(events: Iterable[Event]) -> list[KVEvent]:
    out: list[KVEvent] = []
    for e in events:
        if isinstance(e, Stored):
            parent = BlockHash(e.parent_hash) if e.parent_hash is not None else None
            out.append(BlockStored(tuple(BlockHash(h) for h in e.block_hashes), parent, e.tier))
        elif isinstance(e, Removed):
            out.append(BlockRemoved(tuple(BlockHash(h) for h in e.block_hashes), e.tier))
        else:
            out.append(AllBlocksCleared())
    return out


def to_kvcore_hashes(hashes: Iterable[bytes]) -> list[BlockHash]:
    return [BlockHash(h) for h in hashes]
