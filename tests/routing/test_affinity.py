"""CacheKeyAffinity: requests sharing a prompt_cache_key go where the last one went,
while that replica holds as much of the prompt and keeps up; and no longer."""

from __future__ import annotations

import pytest

from cachepoint.kvcore import PrefixIndex, hash_blocks
from cachepoint.routing import CacheAwarePolicy, CacheKeyAffinity, LeastLoadedPolicy, ReplicaView

BS = 16


def prompt(seed: int, blocks: int = 4) -> list:
    return hash_blocks([seed * 1000 + i for i in range(blocks * BS)], BS, ("m",))


def view(name: str, held: list | None = None, load: int = 0) -> ReplicaView:
    v = ReplicaView(name=name, index=PrefixIndex(held or []))
    v.queued_prefill_tokens = load
    return v


def choose(views: list[ReplicaView], hashes: list) -> object:
    return LeastLoadedPolicy().choose(hashes, views, BS)


def test_a_key_goes_back_where_it_went_while_that_replica_keeps_up():
    aff = CacheKeyAffinity(slack_tokens=1000)
    h = prompt(1)
    first = aff.steer("org:o1:k", choose([view("a"), view("b", load=10)], h), now=0.0)
    assert (first.replica, first.steered) == ("a", False)
    # The policy now prefers b (a is busier), within the slack: the key keeps a.
    d = choose([view("a", load=900), view("b")], prompt(2))
    assert d.replica == "b"
    kept = aff.steer("org:o1:k", d, now=1.0)
    assert (kept.replica, kept.steered) == ("a", True)
    assert kept.span_attributes()["cachepoint.route.cache_key_steered"] is True
    # Past the slack, the overflow goes where the policy says, and the key follows it.
    d = choose([view("a", load=1001), view("b")], prompt(3))
    assert aff.steer("org:o1:k", d, now=2.0).replica == "b"
    d = choose([view("a"), view("b", load=5)], prompt(4))
    assert aff.steer("org:o1:k", d, now=3.0).replica == "b"


def test_the_prefix_still_wins_and_other_keys_and_orgs_are_apart():
    aff = CacheKeyAffinity()
    h = prompt(1)
    aff.steer("org:o1:k", choose([view("a"), view("b", load=1)], h), now=0.0)
    # b holds this prompt, a does not: the key does not pull it away from its cache.
    d = CacheAwarePolicy().choose(h, [view("a"), view("b", held=h)], BS)
    assert d.replica == "b"
    assert aff.steer("org:o1:k", d, now=1.0).replica == "b"
    # Another org's identical key, or no key: untouched.
    d = choose([view("a", load=5), view("b")], prompt(5))
    assert aff.steer("org:o2:k", d, now=1.0).replica == "b"
    assert aff.steer(None, d, now=1.0).replica == "b"


def test_keys_expire_are_bounded_and_forget_a_gone_replica():
    aff = CacheKeyAffinity(ttl_s=10.0, max_keys=2)
    h = prompt(1)
    for k in ("k1", "k2", "k3"):
        aff.steer(k, choose([view("a"), view("b", load=1)], h), now=0.0)
    assert len(aff) == 2  # k1, the oldest, went first
    busy_a = choose([view("a", load=5), view("b")], h)
    assert aff.steer("k1", busy_a, now=1.0).replica == "b"  # forgotten: the policy's
    assert aff.steer("k2", busy_a, now=10.5).replica == "b"  # expired
    aff.forget("b")
    assert aff.steer("k2", choose([view("a"), view("b", load=1)], h), now=11.0).replica == "a"


@pytest.mark.parametrize("bad", [{"ttl_s": 0}, {"max_keys": 0}, {"slack_tokens": -1}])
def test_nonsense_bounds_are_refused(bad):
    with pytest.raises(ValueError, match="must be positive"):
        CacheKeyAffinity(**bad)
