"""The directory's rules, driven by hand-made batches, heartbeats and snapshots."""

from __future__ import annotations

from cachepoint.events import schema
from cachepoint.gateway.directory import ReplicaDirectory
from cachepoint.kvcore import ManualClock, hash_blocks

H = hash_blocks(list(range(16 * 8)), 16)


def batch(seq: int, *events, epoch: int = 1, replica: str = "r0") -> schema.EventBatch:
    return schema.EventBatch(schema.SCHEMA_VERSION, replica, epoch, seq, 0.0, list(events))


def stored(*hashes, parent=None):
    return schema.Stored(list(hashes), parent)


def hb(name="r0", epoch=1, last_seq=0, waiting=0) -> schema.Heartbeat:
    return schema.Heartbeat(
        schema.SCHEMA_VERSION,
        name,
        f"http://{name}",
        epoch,
        "m",
        16,
        last_seq,
        100,
        1,
        waiting,
        8,
        64,
        1,
        2,
        0,
        0,
        0,
        0.0,
    )


def test_directory_applies_batches_in_order():
    d = ReplicaDirectory()
    d.on_heartbeat(hb())
    assert not d.on_batch(batch(1, schema.Cleared()))
    assert not d.on_batch(batch(2, stored(H[0], H[1])))
    assert not d.on_batch(batch(3, schema.Removed([H[1]])))
    (view,) = d.views()
    assert view.index.match(H) == 1
    assert not d.on_batch(batch(3, stored(H[5])))  # a duplicate is ignored
    assert view.index.match(H) == 1


def test_directory_gap_resyncs_and_replays_buffered_batches():
    d = ReplicaDirectory()
    d.on_heartbeat(hb())
    d.on_batch(batch(1, stored(H[0])))
    assert d.on_batch(batch(3, stored(H[2], parent=H[1])))  # seq 2 was lost
    assert d.resyncs == 1
    assert not d.on_batch(batch(4, stored(H[3], parent=H[2])))  # buffered meanwhile
    snap = schema.Snapshot(schema.SCHEMA_VERSION, "r0", 1, 2, [H[0], H[1]])
    assert not d.on_snapshot(snap)
    (view,) = d.views()
    assert view.index.match(H) == 4  # snapshot (0, 1) + replayed 3 and 4
    assert d.replicas["r0"].last_seq == 4


def test_directory_new_epoch_drops_the_old_index():
    d = ReplicaDirectory()
    d.on_heartbeat(hb())
    d.on_batch(batch(1, stored(H[0], H[1])))
    d.on_batch(batch(1, schema.Cleared(), epoch=2))  # the replica restarted
    (view,) = d.views()
    assert len(view.index) == 0
    assert not d.on_batch(batch(2, stored(H[7])))  # a late batch of epoch 1: ignored
    assert len(view.index) == 0


def test_directory_heartbeat_timeout_and_return():
    clock = ManualClock(100.0)
    d = ReplicaDirectory(heartbeat_interval_s=1.0, clock=clock)
    d.on_heartbeat(hb("r0"))
    d.on_heartbeat(hb("r1"))
    clock.advance(2.0)
    d.on_heartbeat(hb("r1"))
    clock.advance(1.5)  # r0 silent for 3.5 s > 3 intervals
    assert d.sweep() == ["r0"]
    assert {v.name: v.live for v in d.views()} == {"r0": False, "r1": True}
    d.on_heartbeat(hb("r0"))
    d.sweep()
    assert all(v.live for v in d.views())
    assert d.heartbeat_misses == 1


def test_directory_heartbeat_reveals_a_lost_last_batch():
    d = ReplicaDirectory()
    d.on_heartbeat(hb(last_seq=0))
    d.on_batch(batch(1, stored(H[0])))
    assert d.on_heartbeat(hb(last_seq=2))  # batch 2 never arrived and nothing follows it


def test_directory_queue_bound_and_load_reach_the_view():
    d = ReplicaDirectory()
    d.on_heartbeat(hb(waiting=8))
    (view,) = d.views()
    assert view.queued_prefill_tokens == 100
    assert not view.routable  # at its queue bound
