"""Random interleavings of every pool operation, with the invariants checked after each."""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cachepoint.kvcore import (
    EVICTION_POLICIES,
    Allocation,
    AllocationState,
    BlockHash,
    BlockPool,
    EntryKey,
    KVCacheManager,
    ManualClock,
    PoolExhaustedError,
    entry_key_at,
    hash_blocks,
)

BLOCK = 2
FAMILIES = 3  # prompts share prefixes within a family, so hits are common
MAX_LEN = 14


def _prompt(family: int, length: int, variant: int) -> list[int]:
    # A shared family prefix, then a variant-specific tail after 6 tokens.
    return [
        family * 1000 + i if i < 6 else family * 1000 + variant * 100 + i for i in range(length)
    ]


class PoolMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 14),
        share=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
        eviction=st.sampled_from(sorted(EVICTION_POLICIES)),
    )
    def setup(self, num_blocks: int, share: float, eviction: str) -> None:
        self.clock = ManualClock(0.0)
        # Every strategy must keep every invariant; only the eviction order differs.
        self.pool = BlockPool(
            num_blocks,
            BLOCK,
            retained_share=share,
            clock=self.clock,
            eviction=EVICTION_POLICIES[eviction](),
        )
        self.mgr = KVCacheManager(self.pool)
        self.open: list[tuple[Allocation, list[int]]] = []
        # Shadow state, independent of the pool's own bookkeeping:
        self.content: dict[int, tuple[int, ...]] = {}  # block id -> full token prefix it holds
        self.retained: dict[BlockHash, float] = {}  # hash -> deadline we were promised
        self.entry_blocks: dict[EntryKey, tuple[BlockHash, ...]] = {}

    # ------------------------------------------------------------------ rules

    @rule(
        family=st.integers(0, FAMILIES - 1),
        length=st.integers(1, MAX_LEN),
        variant=st.integers(0, 2),
    )
    def allocate(self, family: int, length: int, variant: int) -> None:
        toks = _prompt(family, length, variant)
        hs = hash_blocks(toks, BLOCK)
        before = self.pool.counts()
        try:
            alloc = self.mgr.allocate(hs, length)
        except PoolExhaustedError:
            assert self.pool.counts() == before
            return
        # A hit must hold exactly the prompt's prefix, whatever the hashes say.
        for i, block in enumerate(alloc.blocks[: alloc.num_hit_blocks]):
            assert self.content[block.block_id] == tuple(toks[: (i + 1) * BLOCK])
        assert alloc.num_cached_tokens < length
        self.open.append((alloc, toks))

    @precondition(lambda self: any(a.state is AllocationState.PENDING for a, _ in self.open))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        alloc, toks = self._pick(data, AllocationState.PENDING)
        before = {b.block_id: b.block_hash for b in alloc.blocks}
        alloc.commit()
        for i, block in enumerate(alloc.blocks):
            if before[block.block_id] is None and block.block_hash is not None:
                self.content[block.block_id] = tuple(toks[: (i + 1) * BLOCK])

    @precondition(lambda self: any(a.state is AllocationState.PENDING for a, _ in self.open))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        alloc, _ = self._pick(data, AllocationState.PENDING)
        held = [b for b in alloc.blocks]
        refs = {id(b): b.ref_cnt for b in held}
        drops: dict[int, int] = {}
        for b in held:
            drops[id(b)] = drops.get(id(b), 0) + 1
        self.mgr.take_events()
        alloc.abort()
        assert not [e for e in self.mgr.take_events() if type(e).__name__ == "BlockStored"]
        for b in held:
            assert b.ref_cnt == refs[id(b)] - drops[id(b)]
        self.open = [(a, t) for a, t in self.open if a is not alloc]

    @precondition(lambda self: any(a.state is AllocationState.COMMITTED for a, _ in self.open))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        alloc, _ = self._pick(data, AllocationState.COMMITTED)
        alloc.free()
        self.open = [(a, t) for a, t in self.open if a is not alloc]

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), extra=st.integers(1, 5))
    def grow(self, data: st.DataObject, extra: int) -> None:
        alloc, _ = data.draw(st.sampled_from(self.open))
        with contextlib.suppress(PoolExhaustedError):
            alloc.grow(alloc.num_tokens + extra)

    @precondition(lambda self: bool(self.pool.cached))
    @rule(data=st.data(), ttl=st.sampled_from([300.0, 3600.0]))
    def retain(self, data: st.DataObject, ttl: float) -> None:
        hashes = data.draw(st.lists(st.sampled_from(sorted(self.pool.cached)), max_size=4))
        blocks = [self.pool.cached[h] for h in hashes]
        result = self.pool.retain(blocks, ttl)
        if result.ok:
            for h in hashes:
                self.retained[h] = max(self.retained.get(h, 0.0), result.retained_until)

    @precondition(lambda self: any(a.state is AllocationState.COMMITTED for a, _ in self.open))
    @rule(data=st.data(), ttl=st.sampled_from([300.0, 3600.0]))
    def write_entry(self, data: st.DataObject, ttl: float) -> None:
        _alloc, toks = self._pick(data, AllocationState.COMMITTED)
        n = len(toks)
        hs = hash_blocks(toks, BLOCK)
        key = entry_key_at(toks, n, hs, BLOCK, ())
        w = self.mgr.write_entry(key, n, hs, ttl)
        if w.written:
            assert w.expires_at is not None
            covered = tuple(hs[: n // BLOCK])
            self.entry_blocks[key] = covered
            for h in covered:
                self.retained[h] = max(self.retained.get(h, 0.0), self.clock.now + ttl)

    @precondition(lambda self: bool(self.entry_blocks))
    @rule(data=st.data())
    def lookup_entry(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.entry_blocks)))
        hit = self.mgr.lookup_entry([key])
        if hit is not None:
            for h in self.entry_blocks[key]:
                self.retained[h] = max(self.retained.get(h, 0.0), hit.expires_at)

    @rule(seconds=st.sampled_from([1.0, 100.0, 299.0, 301.0, 3599.0, 3601.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def clear(self) -> None:
        self.mgr.clear()
        self.retained.clear()
        self.entry_blocks.clear()

    # ------------------------------------------------------------- invariants

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        c = self.pool.counts()
        assert c.active + c.cached_free + c.empty == c.total
        assert c.retained <= c.max_retained

    @invariant()
    def retained_blocks_are_never_evicted(self) -> None:
        if not hasattr(self, "pool"):
            return
        now = self.clock.now
        for h, deadline in self.retained.items():
            if deadline > now:
                assert h in self.pool.cached, "a retained, unexpired block was evicted"

    def _pick(self, data: st.DataObject, state: AllocationState) -> tuple[Allocation, list[int]]:
        return data.draw(st.sampled_from([(a, t) for a, t in self.open if a.state is state]))

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for alloc, _ in self.open:
            alloc.close()
        self.pool.check_invariants()
        assert self.pool.counts().active == 0


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_pool_stateful = PoolMachine.TestCase
