"""The directory's rules, driven by hand-made batches, heartbeats and snapshots."""

from __future__ import annotations

import logging

import pytest

from cachepoint.events import schema
from cachepoint.gateway.fleet.directory import ReplicaDirectory
from cachepoint.gateway.fleet.trust import UrlPolicy
from cachepoint.kvcore import ManualClock, hash_blocks

H = hash_blocks(list(range(16 * 8)), 16)


def batch(seq: int, *events, epoch: int = 1, replica: str = "r0") -> schema.EventBatch:
    return schema.EventBatch(schema.SCHEMA_VERSION, replica, epoch, seq, 0.0, list(events))


def stored(*hashes, parent=None):
    return schema.Stored(list(hashes), parent)


def hb(name="r0", epoch=1, last_seq=0, waiting=0, url=None) -> schema.Heartbeat:
    return schema.Heartbeat(
        schema.SCHEMA_VERSION,
        name,
        url or f"http://{name}",
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


# ----------------------------------------------------------------- refusals

NOW_NS = 1_800_000_000 * 10**9  # the gateway's wall clock in these tests
SKEW_NS = 60 * 10**9


def stats(epoch: int, name: str = "r0") -> dict[str, object]:
    return {
        "replica": name,
        "epoch": epoch,
        "block_size": 16,
        "model": "m",
        "queued_prefill_tokens": 0,
        "running": 0,
        "waiting": 0,
        "max_waiting": 8,
    }


def test_directory_refuses_epochs_from_the_future_and_changes_nothing():
    d = ReplicaDirectory(max_epoch_skew_s=60, wall_ns=lambda: NOW_NS)
    far = 2**62
    assert not d.on_heartbeat(hb("ghost", epoch=far))
    assert "ghost" not in d.replicas  # not even an empty record
    d.on_heartbeat(hb(epoch=NOW_NS))
    d.on_batch(batch(1, stored(H[0]), epoch=NOW_NS))
    before = (d.replicas["r0"].epoch, d.replicas["r0"].last_seq, d.replicas["r0"].url)
    assert not d.on_heartbeat(hb(epoch=far, url="http://elsewhere"))
    assert not d.on_batch(batch(1, schema.Cleared(), epoch=far))
    assert not d.on_stats("r0", "http://elsewhere", stats(far))
    assert not d.on_snapshot(schema.Snapshot(schema.SCHEMA_VERSION, "r0", far, 0, []))
    st = d.replicas["r0"]
    assert (st.epoch, st.last_seq, st.url) == before
    assert st.view.index.match(H) == 1 and st.view.live
    assert d.rejections == {"future_epoch": 5}
    # The real replica keeps being heard, and a start within the skew is accepted.
    assert not d.on_heartbeat(hb(epoch=NOW_NS))
    d.on_heartbeat(hb(epoch=NOW_NS + SKEW_NS))
    assert d.replicas["r0"].epoch == NOW_NS + SKEW_NS


def test_directory_exact_urls_refuse_a_url_that_is_not_the_names():
    urls = UrlPolicy("exact", {"r0": "http://10.0.0.1:8100", "r1": "http://10.0.0.2:8100"})
    d = ReplicaDirectory(urls=urls)
    assert not d.on_heartbeat(hb("r0", url="http://10.0.0.2:8100"))  # r1's URL
    assert not d.on_heartbeat(hb("rogue", url="http://10.9.9.9:8100"))  # not configured
    assert d.replicas == {} and d.rejections == {"url": 2}
    d.on_heartbeat(hb("r0", url="http://10.0.0.1:8100/"))  # a trailing slash is the same
    assert d.on_stats("r1", "http://10.0.0.2:8100", stats(1, "r1"))
    assert not d.on_stats("r1", "http://10.0.0.1:8100", stats(1, "r1"))
    assert {v.name for v in d.views() if v.live} == {"r0", "r1"}
    assert d.url_of("r1") == "http://10.0.0.2:8100"


def test_directory_k8s_dns_urls_must_be_the_announced_pods():
    d = ReplicaDirectory(urls=UrlPolicy("k8s-dns"))
    ok = "http://big-0.big.prod.svc.cluster.local:8100"
    assert not d.on_heartbeat(hb("prod-big-1", url=ok))  # another pod's address
    assert not d.on_heartbeat(hb("prod_big-0", url="http://10.1.2.3:8100"))
    d.on_heartbeat(hb("prod_big-0", url=ok))
    assert [v.name for v in d.views()] == ["prod_big-0"]
    assert d.rejections == {"url": 2}


def test_directory_refusals_are_logged_at_most_once_a_minute(caplog):
    clock = ManualClock(0.0)
    d = ReplicaDirectory(clock=clock, wall_ns=lambda: NOW_NS)
    with caplog.at_level(logging.WARNING, logger="cachepoint.gateway.fleet.directory"):
        for _ in range(50):
            d.on_heartbeat(hb(epoch=2**62))
        clock.advance(61)
        d.on_heartbeat(hb(epoch=2**62))
    assert d.rejections == {"future_epoch": 51}
    assert sum("future_epoch" in r.message for r in caplog.records) == 2


def test_directory_failed_health_check_overrides_heartbeats():
    clock = ManualClock(100.0)
    d = ReplicaDirectory(clock=clock)
    d.on_heartbeat(hb("r0"))
    d.on_heartbeat(hb("r1"))
    d.mark_unhealthy("r0", "/readyz answered 503")
    d.on_heartbeat(hb("r0"))  # still heartbeating: still out
    d.sweep()
    assert {v.name: v.live for v in d.views()} == {"r0": False, "r1": True}
    assert d.health_downs == 1
    d.mark_healthy("r0")
    assert d.replicas["r0"].view.live
    d.mark_unhealthy("r0", "connect error")
    d.on_heartbeat(hb("r0", epoch=2))  # a restart is judged afresh
    assert d.replicas["r0"].view.live and d.health_downs == 2
    # Counted even when silence had already taken it out: the count does not depend on
    # which of the two checks noticed first.
    clock.advance(60)
    d.sweep()
    assert not d.replicas["r0"].view.live
    d.mark_unhealthy("r0", "/readyz answered 503")
    d.mark_unhealthy("r0", "/readyz answered 503")  # still down: once
    assert d.health_downs == 3


@pytest.mark.parametrize(
    "bad",
    [{"block_size": None}, {"max_waiting": "lots"}, {"running": [1]}, {"model": None, "x": 1}],
)
def test_a_malformed_stats_answer_changes_nothing(bad: dict[str, object]) -> None:
    d = ReplicaDirectory(wall_ns=lambda: NOW_NS)
    d.on_heartbeat(hb(epoch=NOW_NS - 1))
    before = (d.replicas["r0"].epoch, d.replicas["r0"].url, d.replicas["r0"].block_size)
    body = {**stats(NOW_NS), **bad}
    if "x" in bad:
        del body["block_size"]
    with pytest.raises((KeyError, ValueError, TypeError)):
        d.on_stats("r0", "http://other:1", body)
    st = d.replicas["r0"]
    assert (st.epoch, st.url, st.block_size) == before  # no half-applied answer


def test_a_replica_on_another_block_size_is_named_once_and_still_routed(caplog) -> None:
    clock = ManualClock()
    d = ReplicaDirectory(clock=clock, block_size=32)  # the gateway hashes in blocks of 32
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            d.on_heartbeat(hb("r0"))  # the heartbeat says 16
    said = [r.getMessage() for r in caplog.records if "blocks of 16 tokens" in r.getMessage()]
    assert len(said) == 1  # once a minute, not per heartbeat
    assert "--block-size" in said[0]
    assert [v.name for v in d.views() if v.live] == ["r0"]  # load routing goes on
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ReplicaDirectory(clock=clock, block_size=16).on_heartbeat(hb("r1"))
    assert not caplog.records


def test_the_directory_remembers_the_tier_a_block_last_left():
    """Cache diagnostics name the tier an evicted entry was last in: the tier the
    replica's events last removed a block from, once no tier holds it."""
    from cachepoint.kvcore import Tier

    d = ReplicaDirectory()
    d.on_heartbeat(hb())
    assert not d.on_batch(batch(1, schema.Cleared(), stored(H[0], H[1], H[2])))
    # H[0] is demoted to the host tier, then dropped from it; H[1] is dropped at once.
    demoted = [schema.Removed([H[0]]), schema.Stored([H[0]], None, Tier.HOST)]
    assert not d.on_batch(batch(2, *demoted, schema.Removed([H[1]])))
    assert d.evicted_from("r0", H[0]) is None  # still held, in the host tier
    assert d.evicted_from("r0", H[1]) == Tier.DEVICE
    assert not d.on_batch(batch(3, schema.Removed([H[0]], Tier.HOST)))
    assert d.evicted_from("r0", H[0]) == Tier.HOST
    assert d.evicted_from("r0", H[2]) is None  # never removed
    assert d.evicted_from("r9", H[0]) is None  # an unknown replica
    # Stored again (the turn that missed it recomputes it before its bill asks): still
    # the tier it was evicted from.
    assert not d.on_batch(batch(4, stored(H[1])))
    assert d.evicted_from("r0", H[1]) == Tier.DEVICE
    # A new process removed nothing it held: a restart is not an eviction.
    d.on_heartbeat(hb(epoch=2))
    assert d.evicted_from("r0", H[0]) is None
