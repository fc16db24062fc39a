"""The retention connector's bookkeeping (`PinTable`) on a stand-in for vLLM's
``BlockPool`` with vLLM's refcount rules: every pin is one reference per block, dropped
exactly once (expiry, replacement, release), and nothing else moves a count."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepoint.replica.vllm_engine.pins import PARAMS_KEY, PinSpec, PinTable

BLOCK = 4


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    is_null: bool = False
    block_hash: object = None


class Pool:
    """vLLM's touch/free_blocks on ref counts, refusing what vLLM would corrupt on."""

    def __init__(self, n: int) -> None:
        self.blocks = [Block(i, block_hash=("h", i)) for i in range(n)]

    def touch(self, blocks):
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks):
        for b in blocks:
            assert b.ref_cnt > 0, f"block {b.block_id} freed below zero"
            b.ref_cnt -= 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _table(n: int = 12):
    pool, clock = Pool(n), Clock()
    return pool, clock, PinTable(pool, clock=clock)


def test_a_pin_holds_a_reference_until_its_deadline():
    pool, clock, table = _table()
    report = table.finished([PinSpec("e1", 3, 10.0)], [0, 1, 2, 3], 16, BLOCK)
    assert (report.pinned, report.pinned_blocks) == (1, 3)
    assert [b.ref_cnt for b in pool.blocks[:4]] == [1, 1, 1, 0]
    clock.now = 9.9
    assert table.expire() == 0
    clock.now = 10.0
    assert table.expire() == 1
    assert [b.ref_cnt for b in pool.blocks[:4]] == [0, 0, 0, 0]
    assert table.expired == 1


def test_a_read_extends_the_pin_without_a_second_reference():
    pool, clock, table = _table()
    table.finished([PinSpec("e1", 2, 10.0)], [0, 1], 8, BLOCK)
    clock.now = 8.0
    report = table.finished([PinSpec("e1", 2, 10.0)], [0, 1, 5], 12, BLOCK)
    assert (report.pinned, report.refreshed) == (0, 1)
    assert [b.ref_cnt for b in pool.blocks[:2]] == [1, 1]
    clock.now = 10.0
    assert table.expire() == 0  # extended to 18
    clock.now = 18.0
    assert table.expire() == 1
    assert pool.blocks[0].ref_cnt == 0


def test_nested_entries_pin_shared_blocks_once_each():
    pool, clock, table = _table()
    table.finished([PinSpec("short", 1, 5.0), PinSpec("long", 3, 50.0)], [0, 1, 2], 12, BLOCK)
    assert pool.blocks[0].ref_cnt == 2 and table.pinned_blocks == 3
    clock.now = 5.0
    table.expire()
    assert [b.ref_cnt for b in pool.blocks[:3]] == [1, 1, 1]


def test_a_prefix_the_request_never_computed_is_not_pinned():
    pool, _, table = _table()
    # aborted after 5 tokens: the 2-block entry (8 tokens) was not computed
    report = table.finished([PinSpec("e", 2, 10.0)], [0, 1], 5, BLOCK)
    assert (report.pinned, report.skipped) == (0, 1)
    pool.blocks[3].block_hash = None  # vLLM did not cache it
    report = table.finished([PinSpec("f", 4, 10.0)], [0, 1, 2, 3], 16, BLOCK)
    assert (report.pinned, report.skipped) == (0, 1)
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_release_all_drops_every_reference_once():
    pool, _, table = _table()
    table.finished([PinSpec("a", 2, 10.0), PinSpec("b", 3, 99.0)], [0, 1, 2], 12, BLOCK)
    assert table.release_all() == 2
    assert table.release_all() == 0
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert table.expire(1e9) == 0  # the released pins' deadlines are gone too


def test_params_are_parsed_strictly():
    assert PinSpec.parse(None) == []
    assert PinSpec.parse({"other": 1}) == []
    params = {PARAMS_KEY: {"pins": [{"key": "k", "blocks": 2, "ttl": 300}]}}
    assert PinSpec.parse(params) == [PinSpec("k", 2, 300.0)]
    with pytest.raises(ValueError, match="must be positive"):
        PinSpec.parse({PARAMS_KEY: {"pins": [{"key": "k", "blocks": 0, "ttl": 300}]}})


ops = st.lists(
    st.one_of(
        # a request finishes: which entry keys, over which of its block ids, how far computed
        st.tuples(
            st.just("finish"),
            st.lists(st.tuples(st.integers(0, 4), st.integers(1, 4)), min_size=1, max_size=3),
            st.permutations(list(range(8))),
            st.integers(0, 8 * BLOCK),
            st.sampled_from([1.0, 5.0, 30.0]),
        ),
        # vLLM itself holds and lets go of blocks (running requests, preemption)
        st.tuples(st.just("hold"), st.integers(0, 7)),
        st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0, 10.0])),
        st.tuples(st.just("reset")),
    ),
    max_size=50,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_every_reference_is_the_pins_or_vllms_and_each_is_dropped_once(ops):
    pool, clock, table = _table(8)
    held: list[int] = []  # references vLLM's own requests hold (preemption frees them)
    for op in ops:
        if op[0] == "finish":
            _, entries, ids, computed, ttl = op
            specs = [PinSpec(f"e{k}", n, ttl) for k, n in entries]
            table.finished(specs, ids[:4], computed, BLOCK)
        elif op[0] == "hold":
            b = op[1]
            if b in held:
                held.remove(b)  # preempted or finished: vLLM frees its reference
                pool.free_blocks([pool.blocks[b]])
            else:
                held.append(b)
                pool.touch([pool.blocks[b]])
        elif op[0] == "tick":
            clock.now += op[1]
            table.expire()
        else:
            table.release_all()
        # the invariant: a block's count is vLLM's references plus the pins'
        for b in pool.blocks:
            pins = sum(1 for p in table.pins.values() if any(x is b for x in p.blocks))
            assert b.ref_cnt == held.count(b.block_id) + pins
            assert table.refs(b.block_id) == pins
            assert all(p.until > clock.now for p in table.pins.values())
    table.release_all()
    for b in pool.blocks:
        assert b.ref_cnt == held.count(b.block_id)
