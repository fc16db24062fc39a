"""RoutedBlocks: what was routed to a replica counts until its events speak, and no longer."""

from __future__ import annotations

import pytest

from cachepoint.kvcore import PrefixIndex, hash_blocks
from cachepoint.routing import CacheAwarePolicy, PrefixAffinityPolicy, ReplicaView, RoutedBlocks

BS = 16
SYSTEM = list(range(4 * BS))  # a tenant's 4-block system prompt


def session(sid: int) -> list:
    """A session's first turn: the shared system prompt, then two private blocks."""
    return hash_blocks(SYSTEM + [100_000 * (sid + 1) + i for i in range(2 * BS)], BS, ("m",))


def test_entries_run_from_the_start_given_and_stop_at_the_first_gap():
    r = RoutedBlocks()
    h = session(0)
    r.add(h[:3], now=0.0)
    assert r.run(h, 0) == 3
    assert r.run(h, 1) == 2
    assert r.run(h, 3) == 0
    r.forget([h[1]])  # the replica's events named it: the index speaks for it now
    assert r.run(h, 0) == 1
    assert r.run(h, 2) == 1


def test_entries_expire_at_their_deadline_and_re_routing_renews_them():
    r = RoutedBlocks(ttl_s=10.0)
    h = session(0)
    r.add(h[:2], now=0.0)
    r.add(h[2:4], now=5.0)
    r.expire(9.9)
    assert len(r) == 4
    r.add(h[:1], now=9.9)  # routed again: counts from now
    r.expire(10.0)
    assert h[0] in r and h[1] not in r and h[2] in r
    r.expire(15.0)
    assert h[2] not in r and h[0] in r
    r.expire(19.9)
    assert not r


def test_the_oldest_go_first_beyond_the_bound():
    r = RoutedBlocks(max_blocks=4)
    h = session(0)
    r.add(h, now=0.0)
    assert len(r) == 4
    assert [x in r for x in h] == [False, False, True, True, True, True]


@pytest.mark.parametrize("bad", [{"ttl_s": 0}, {"max_blocks": 0}])
def test_nonsense_bounds_are_refused(bad):
    with pytest.raises(ValueError, match="must be positive"):
        RoutedBlocks(**bad)


@pytest.mark.parametrize("policy", [CacheAwarePolicy(), PrefixAffinityPolicy()])
def test_a_second_session_follows_the_first_before_any_event(policy):
    """Two sessions of one tenant, routed back to back: the second sees where the first went."""
    replicas = [ReplicaView(n) for n in "abc"]
    first = policy.choose(session(0), replicas, BS)
    chosen = next(v for v in replicas if v.name == first.replica)
    chosen.routed.add(session(0), now=0.0)
    second = policy.choose(session(1), replicas, BS)
    assert second.replica == first.replica
    # The shared system prompt, 4 blocks, counts as routed; the private blocks do not.
    assert second.routed_blocks == 4 and second.matched_tokens == 4 * BS
    assert (
        f"{first.replica}:matched=64"
        in second.span_attributes()["cachepoint.route.candidates"]["abc".index(first.replica)]
    )


def test_routed_blocks_extend_what_the_index_holds():
    h = session(0)
    v = ReplicaView("a", PrefixIndex(h[:2]))
    v.routed.add(h[2:5], now=0.0)
    d = CacheAwarePolicy().choose(h, [v], BS, num_tokens=len(h) * BS)
    # 5 usable blocks (the last token's block is recomputed): 2 held, 3 routed.
    assert (d.matched_blocks, d.routed_blocks) == (5, 3)
    assert d.span_attributes()["cachepoint.route.routed_blocks"] == 3


def test_a_held_prefix_still_beats_a_routed_one_of_the_same_length_only_by_load():
    """Routed and held count alike: the load then decides, as between two holders."""
    h = session(0)
    holder = ReplicaView("held", PrefixIndex(h[:4]), queued_prefill_tokens=10_000)
    routed = ReplicaView("routed")
    routed.routed.add(h[:4], now=0.0)
    d = CacheAwarePolicy().choose(h, [holder, routed], BS)
    assert d.replica == "routed"
