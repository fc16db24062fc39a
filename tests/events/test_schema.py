from __future__ import annotations

import msgspec
import pytest

from cachepoint.events import schema
from cachepoint.events.subjects import check_replica_name, kv_subject, snapshot_subject
from cachepoint.kvcore import AllBlocksCleared, BlockRemoved, BlockStored, hash_blocks


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
