from __future__ import annotations

import msgspec
import pytest

from cachepoint.events import schema
from cachepoint.events.subjects import check_replica_name, kv_subject, snapshot_subject
from cachepoint.kvcore import AllBlocksCleared, BlockRemoved, BlockStored, Tier, hash_blocks


def test_schema_round_trips_kvcore_events():
    hs = hash_blocks(list(range(64)), 16)
    events = [
        AllBlocksCleared(),
        BlockStored(tuple(hs[:2]), None),
        BlockStored(tuple(hs[2:]), hs[1]),
        BlockRemoved((hs[3],)),
    ]
    batch = schema.EventBatch(schema.SCHEMA_VERSION, "r0", 7, 3, 1.5, schema.to_wire(events))
    back = schema.decode(schema.encode(batch), schema.EventBatch)
    assert back == batch
    assert schema.to_kvcore(back.events) == events


def test_schema_is_compact():
    hs = hash_blocks(list(range(16 * 64)), 16)
    batch = schema.EventBatch(1, "r0", 1, 1, 0.0, schema.to_wire([BlockStored(tuple(hs), None)]))
    # 64 hashes of 16 bytes plus a little framing: no per-event field names.
    assert len(schema.encode(batch)) < 64 * 18 + 80


def test_schema_refuses_unknown_versions_and_garbage():
    future = schema.EventBatch(99, "r0", 1, 1, 0.0, [])
    with pytest.raises(schema.SchemaError, match="v99"):
        schema.decode(schema.encode(future), schema.EventBatch)
    with pytest.raises(schema.SchemaError, match="not a Heartbeat"):
        schema.decode(b"\x00garbage", schema.Heartbeat)
    with pytest.raises(schema.SchemaError):
        schema.decode(msgspec.msgpack.encode({"v": 1}), schema.Snapshot)


def test_subjects_and_names():
    assert kv_subject("r-1") == "cachepoint.kv.r-1"
    assert snapshot_subject("r-1") == "cachepoint.kv.snapshot.r-1"
    for bad in ("a.b", "", "a b", "snapshot", "x" * 65):
        with pytest.raises(ValueError, match="replica name"):
            check_replica_name(bad)


# ----------------------------------------------------------------------------- tiers


class _OldStored(msgspec.Struct, tag="stored", array_like=True, frozen=True):
    """`Stored` as builds before the KV tiers wrote and read it."""

    block_hashes: list[bytes]
    parent_hash: bytes | None


def test_schema_round_trips_tiers():
    hs = hash_blocks(list(range(64)), 16)
    events = [
        BlockRemoved((hs[3],)),
        BlockStored((hs[3],), None, Tier.HOST),
        BlockStored((hs[2],), None, Tier.DISK),
        BlockStored((hs[3],), hs[2], Tier.DEVICE),
        BlockRemoved((hs[3],), Tier.HOST),
    ]
    batch = schema.EventBatch(schema.SCHEMA_VERSION, "r0", 7, 3, 1.5, schema.to_wire(events))
    back = schema.decode(schema.encode(batch), schema.EventBatch)
    tiers = [getattr(e, "tier", None) for e in back.events]
    assert tiers == ["device", "host", "disk", "device", "host"]
    assert schema.to_kvcore(back.events) == events
    assert all(isinstance(getattr(e, "tier", None), Tier) for e in schema.to_kvcore(back.events))


def test_old_tierless_messages_read_as_device_and_old_readers_read_new_ones():
    hs = hash_blocks(list(range(32)), 16)
    # What a replica built before the tiers sends: no tier items, no cost fields.
    old = msgspec.msgpack.encode(
        {
            "v": 1,
            "replica": "r0",
            "epoch": 1,
            "seq": 1,
            "ts": 0.0,
            "events": [["stored", [hs[0], hs[1]], None], ["removed", [hs[1]]], ["cleared"]],
        }
    )
    batch = schema.decode(old, schema.EventBatch)
    assert schema.to_kvcore(batch.events) == [
        BlockStored((hs[0], hs[1]), None, Tier.DEVICE),
        BlockRemoved((hs[1],), Tier.DEVICE),
        AllBlocksCleared(),
    ]
    snap = schema.decode(
        msgspec.msgpack.encode(
            {"v": 1, "replica": "r0", "epoch": 1, "seq": 1, "block_hashes": [hs[0]]}
        ),
        schema.Snapshot,
    )
    assert (snap.block_hashes, snap.host_hashes, snap.disk_hashes) == ([hs[0]], [], [])
    # A gateway built before the tiers reads a new sender's events (the tier is ignored).
    new = msgspec.msgpack.encode(schema.to_wire([BlockStored((hs[0],), None, Tier.HOST)])[0])
    assert msgspec.msgpack.decode(new, type=_OldStored) == _OldStored([hs[0]], None)


def test_unknown_tier_is_refused_as_a_schema_error():
    hs = hash_blocks(list(range(16)), 16)
    bad = msgspec.msgpack.encode(
        {
            "v": 1,
            "replica": "r0",
            "epoch": 1,
            "seq": 1,
            "ts": 0.0,
            "events": [["stored", [hs[0]], None, "tape"]],
        }
    )
    with pytest.raises(schema.SchemaError, match=r"not a EventBatch.*'tape'"):
        schema.decode(bad, schema.EventBatch)
    bad_removed = msgspec.msgpack.encode(
        {
            "v": 1,
            "replica": "r0",
            "epoch": 1,
            "seq": 1,
            "ts": 0.0,
            "events": [["removed", [hs[0]], 3]],
        }
    )
    with pytest.raises(schema.SchemaError, match="not a EventBatch"):
        schema.decode(bad_removed, schema.EventBatch)


def test_heartbeat_carries_the_cost_model_and_old_heartbeats_default_it():
    fields = dict(
        v=1, name="r0", url="http://r0", epoch=1, model="m", block_size=16, last_seq=0,
        queued_prefill_tokens=0, running=0, waiting=0, max_waiting=8, blocks_total=64,
        blocks_active=0, blocks_cached_free=0, blocks_retained=0, hit_tokens=0,
        query_tokens=0, ts=0.0,
    )  # fmt: skip
    old = schema.decode(msgspec.msgpack.encode(fields), schema.Heartbeat)
    assert (old.kv_bytes_per_token, old.prefill_tokens_per_s) == (0, 0.0)
    assert (old.host_read_bytes_per_s, old.disk_read_bytes_per_s) == (0.0, 0.0)
    beat = schema.Heartbeat(
        **fields,  # type: ignore[arg-type]
        kv_bytes_per_token=131072,
        prefill_tokens_per_s=12_000.0,
        host_read_bytes_per_s=50e9,
        disk_read_bytes_per_s=6e9,
    )
    assert schema.decode(schema.encode(beat), schema.Heartbeat) == beat
