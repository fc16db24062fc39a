from __future__ import annotations

import pytest

from cachepoint.kvcore import BlockPool, KVCacheManager, ManualClock
from cachepoint.replica import admission
from cachepoint.replica.admission import EntrySpan

B = 4


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(BlockPool(64, B, retained_share=0.5, clock=ManualClock(0.0)))


def _run(manager: KVCacheManager, tokens: list[int], bps: list[EntrySpan]):
    """Admission, a (pretend) successful prefill, commit and entry writes."""
    schedule = admission.key_schedule([(0, ["m", "org:a"])])
    cp = admission.plan(manager, tokens, schedule, bps)
    alloc = manager.allocate(cp.block_hashes, len(tokens))
    alloc.commit()
    admission.write_entries(manager, cp)
    alloc.free()
    return cp


def bp(pos: int, ttl: str = "5m", boundaries: tuple[int, ...] = ()) -> EntrySpan:
    return EntrySpan(pos, ttl, ("m", "org:a"), boundaries)


def test_admission_first_turn_writes_up_to_last_breakpoint(manager):
    toks = list(range(40))
    cp = _run(manager, toks, [bp(30)])
    assert cp.entry_hit_tokens == 0
    assert admission.written_tokens(cp) == (30, 0)


def test_admission_second_turn_reads_what_first_wrote(manager):
    first = list(range(40))
    _run(manager, first, [bp(30)])
    second = [*first, *range(100, 120)]
    cp = _run(manager, second, [bp(55, boundaries=(45, 30))])
    assert (cp.entry_hit_tokens, cp.entry_hit_lookback) == (30, 2)
    assert admission.written_tokens(cp) == (25, 0)  # 55 - 30


def test_admission_mixed_ttls_split_a_b_c(manager):
    toks = list(range(80))
    _run(manager, toks[:20], [bp(12, "1h")])  # A will be 12
    cp = _run(manager, toks, [bp(12, "1h"), bp(40, "1h"), bp(64, "5m")])
    assert cp.entry_hit_tokens == 12
    w5m, w1h = admission.written_tokens(cp)
    assert w1h == 40 - 12  # B - A
    assert w5m == 64 - 40  # C - B


def test_admission_refused_retention_is_not_a_write(manager):
    small = KVCacheManager(BlockPool(16, B, retained_share=0.25, clock=ManualClock(0.0)))
    toks = list(range(40))  # 10 blocks; only 4 may be retained
    cp = _run(small, toks, [bp(12), bp(36)])
    assert cp.written == [(12, "5m")]
    assert cp.refusal_reason is not None
    assert admission.written_tokens(cp) == (12, 0)


def test_admission_other_org_never_hits(manager):
    toks = list(range(40))
    _run(manager, toks, [bp(30)])
    schedule = admission.key_schedule([(0, ["m", "org:b"])])
    cp = admission.plan(manager, toks, schedule, [EntrySpan(30, "5m", ("m", "org:b"))])
    assert cp.entry_hit_tokens == 0
    assert manager.match(cp.block_hashes, 40).num_blocks == 0


def test_admission_keys_at_block_follows_spans():
    sched = admission.key_schedule([(0, ["g"]), (3, ["o"])])
    assert admission.keys_at_block(sched, 2) == ("g",)
    assert admission.keys_at_block(sched, 3) == ("o",)
    assert admission.key_schedule([])[0].extra_keys == ()
