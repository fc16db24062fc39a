"""The gateway's directory applies tiers from events and snapshots, and each heartbeat's
cost model to the replica's view (hand-made messages, no NATS)."""

from __future__ import annotations

import pytest

from cachepoint.events import schema
from cachepoint.gateway.fleet.directory import ReplicaDirectory
from cachepoint.kvcore import BlockRemoved, BlockStored, Tier, hash_blocks
from cachepoint.routing import CacheAwarePolicy, TierValue, tier_value

BS = 16
H = hash_blocks(list(range(BS * 8)), BS)
KV = 128 * 1024


def batch(seq: int, *events: schema.Event, replica: str = "r0") -> schema.EventBatch:
    return schema.EventBatch(schema.SCHEMA_VERSION, replica, 1, seq, 0.0, list(events))


def hb(name: str = "r0", **cost: float) -> schema.Heartbeat:
    return schema.Heartbeat(
        schema.SCHEMA_VERSION,
        name,
        f"http://{name}",
        1,
        "m",
        BS,
        0,
        0,
        0,
        0,
        8,
        64,
        0,
        0,
        0,
        0,
        0,
        0.0,
        **cost,  # type: ignore[arg-type]
    )


def test_directory_applies_tiers_from_event_batches():
    d = ReplicaDirectory()
    d.on_heartbeat(hb())
    d.on_batch(batch(1, *schema.to_wire([BlockStored(tuple(H[:4]), None)])))
    # Demote H[2:4]: removed from the device at eviction, stored in host after the copy.
    d.on_batch(batch(2, *schema.to_wire([BlockRemoved(tuple(H[2:4]))])))
    d.on_batch(batch(3, *schema.to_wire([BlockStored(tuple(H[2:4]), None, Tier.HOST)])))
    d.on_batch(batch(4, schema.Stored([H[4]], None, Tier.DISK)))
    (view,) = d.views()
    m = view.index.match_tiers(H)
    assert (m.device, m.host, m.disk) == (2, 2, 1)
    # Promote H[2]: device stored and host removed in one batch.
    d.on_batch(
        batch(
            5,
            *schema.to_wire(
                [BlockStored((H[2],), H[1]), BlockRemoved((H[2],), Tier.HOST)],
            ),
        )
    )
    assert [view.index.tier_of(h) for h in H[:6]] == [
        Tier.DEVICE,
        Tier.DEVICE,
        Tier.DEVICE,
        Tier.HOST,
        Tier.DISK,
        None,
    ]


def test_snapshot_restores_every_tier():
    d = ReplicaDirectory()
    d.on_heartbeat(hb())
    d.begin_resync("r0")
    snap = schema.Snapshot(
        schema.SCHEMA_VERSION, "r0", 1, 7, [H[0]], host_hashes=[H[1], H[2]], disk_hashes=[H[3]]
    )
    assert not d.on_snapshot(snap)
    (view,) = d.views()
    m = view.index.match_tiers(H)
    assert (m.device, m.host, m.disk) == (1, 2, 1)


def test_heartbeat_cost_model_prices_the_view():
    d = ReplicaDirectory()
    d.on_heartbeat(hb())
    (view,) = d.views()
    assert view.tier_value == TierValue()  # not reported: the conservative defaults
    d.on_heartbeat(
        hb(
            kv_bytes_per_token=KV,
            prefill_tokens_per_s=10_000.0,
            host_read_bytes_per_s=50e9,
            disk_read_bytes_per_s=2e9,
        )
    )
    assert view.tier_value == tier_value(KV, 10_000, 50e9, 2e9)
    assert view.tier_value.host == pytest.approx(1 - KV * 10_000 / 50e9)


def test_gateway_routes_by_the_tiers_it_was_told():
    d = ReplicaDirectory()
    fast = dict(kv_bytes_per_token=KV, prefill_tokens_per_s=20_000.0, host_read_bytes_per_s=50e9)
    slow = dict(kv_bytes_per_token=KV, prefill_tokens_per_s=20_000.0, host_read_bytes_per_s=1e9)
    d.on_heartbeat(hb("fast", **fast))
    d.on_heartbeat(hb("slow", **slow))
    d.on_heartbeat(hb("none"))
    for name in ("fast", "slow"):
        d.on_batch(batch(1, schema.Stored(list(H[:6]), None, Tier.HOST), replica=name))
    policy = CacheAwarePolicy(tie_tolerance=0)
    decision = policy.choose(H[:6], d.views(), BS)
    assert decision.replica == "fast"
    scores = {c.replica: c.saved_tokens for c in decision.candidates}
    assert scores["slow"] == 0.0  # its copy is slower than recompute: no better than "none"
    assert scores["none"] == 0.0
