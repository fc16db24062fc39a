"""`PinLedger` against kvcore's model: the same retains, expiries and clock moves on a
`BlockPool` (every block indexed and free, so only retention decides) and on a ledger
over the same blocks' hashes must give the same answers and the same charges."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.kvcore import BlockPool, ManualClock, PinLedger, RetentionOwner, hash_blocks

BLOCK = 4
NUM_BLOCKS = 16
OWNERS = [
    RetentionOwner("org:a"),
    RetentionOwner("org:b", share=0.25),
    RetentionOwner("org:c", share=1.0),
]


def _pool_and_ledger(retained_share: float, owner_share: float):
    clock = ManualClock(1000.0)
    pool = BlockPool(
        NUM_BLOCKS, BLOCK, retained_share=retained_share, owner_share=owner_share, clock=clock
    )
    hashes = hash_blocks(list(range(NUM_BLOCKS * BLOCK)), BLOCK)
    blocks = pool.allocate(NUM_BLOCKS)
    pool.publish(blocks, hashes, None)
    pool.free(reversed(blocks))
    ledger = PinLedger(
        NUM_BLOCKS, retained_share=retained_share, owner_share=owner_share, clock=clock
    )
    by_hash = {b.block_hash: b for b in blocks}
    return clock, pool, ledger, hashes, by_hash


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("retain"),
            st.integers(0, NUM_BLOCKS - 1),  # first block
            st.integers(1, 6),  # how many
            st.sampled_from([5.0, 30.0, 300.0]),  # ttl
            st.integers(0, len(OWNERS) - 1),
        ),
        st.tuples(st.just("tick"), st.sampled_from([1.0, 10.0, 100.0, 400.0])),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(
    ops=ops,
    retained_share=st.sampled_from([0.25, 0.5, 1.0]),
    owner_share=st.sampled_from([0.5, 1.0]),
)
def test_the_ledger_decides_as_the_pool_does(ops, retained_share, owner_share):
    clock, pool, ledger, hashes, by_hash = _pool_and_ledger(retained_share, owner_share)
    for op in ops:
        if op[0] == "tick":
            clock.advance(op[1])
            assert pool.expire() == ledger.expire()
        else:
            _, first, n, ttl, who = op
            chosen = hashes[first : first + n]
            a = pool.retain([by_hash[h] for h in chosen], ttl, OWNERS[who])
            b = ledger.retain(chosen, ttl, OWNERS[who])
            assert (a.ok, a.newly_retained, a.retained_until, a.reason) == (
                b.ok,
                b.newly_retained,
                b.retained_until,
                b.reason,
            )
        assert pool.retained_owners() == ledger.retained_owners()
        for h in hashes:
            assert by_hash[h].retained_until == ledger.retained_until(h)
        assert pool.num_retain_refusals == ledger.num_retain_refusals
        assert pool.num_quota_refusals == ledger.num_quota_refusals


def test_a_refused_retain_changes_nothing():
    clock = ManualClock(0.0)
    ledger = PinLedger(8, retained_share=0.5, clock=clock)  # cap 4
    assert ledger.retain([1, 2, 3], 300, RetentionOwner("org:a")).ok
    refused = ledger.retain([3, 4, 5], 3600, RetentionOwner("org:b"))
    assert not refused.ok
    assert refused.reason == "retained share cap: 3 of 4 blocks retained, 2 more requested"
    assert ledger.retained_until(3) == 300.0  # not extended by the refused retain
    assert ledger.retained_owners() == {"org:a": 3}


def test_expiry_releases_each_block_once_and_counts_it():
    clock = ManualClock(0.0)
    ledger = PinLedger(8, retained_share=1.0, clock=clock)
    ledger.retain([1, 2], 10, RetentionOwner("org:a"))
    ledger.retain([2, 3], 20, RetentionOwner("org:b"))  # 2 stays org:a's, extended to 20
    clock.advance(10)
    assert ledger.expire() == 1  # block 1 only
    assert ledger.retained_owners() == {"org:a": 1, "org:b": 1}
    clock.advance(10)
    assert ledger.expire() == 2
    assert ledger.expire() == 0
    assert ledger.stats().expired == 3
    assert len(ledger) == 0


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="retained_share"):
        PinLedger(8, retained_share=1.5)
    with pytest.raises(ValueError, match="ttl must be positive"):
        PinLedger(8).retain([1], 0)
