"""Random interleavings of every pool operation, with the invariants checked after each."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cachepoint.kvcore import (
    EVICTION_POLICIES,
    UNATTRIBUTED,
    Allocation,
    AllocationState,
    BlockHash,
    BlockPool,
    EntryKey,
    KVCacheManager,
    ManualClock,
    PoolExhaustedError,
    RetentionOwner,
    entry_key_at,
    hash_blocks,
)

BLOCK = 2
FAMILIES = 3  # prompts share prefixes within a family, so hits are common
MAX_LEN = 14
SHARES = [None, 0.0, 0.25, 0.5, 1.0]  # an owner's share; None = the pool's owner_share


def _prompt(family: int, length: int, variant: int) -> list[int]:
    # A shared family prefix, then a variant-specific tail after 6 tokens.
    return [
        family * 1000 + i if i < 6 else family * 1000 + variant * 100 + i for i in range(length)
    ]


class PoolMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(3, 14),
        share=st.sampled_from([0.0, 0.25, 0.5, 1.0]),
        owner_share=st.sampled_from([0.5, 1.0]),
        owner_shares=st.tuples(st.sampled_from(SHARES), st.sampled_from(SHARES)),
        eviction=st.sampled_from(sorted(EVICTION_POLICIES)),
    )
    def setup(
        self,
        num_blocks: int,
        share: float,
        owner_share: float,
        owner_shares: tuple[float | None, float | None],
        eviction: str,
    ) -> None:
        self.clock = ManualClock(0.0)
        # Every strategy must keep every invariant; only the eviction order differs.
        self.pool = BlockPool(
            num_blocks,
            BLOCK,
            retained_share=share,
            owner_share=owner_share,
            clock=self.clock,
            eviction=EVICTION_POLICIES[eviction](),
        )
        # Two tenants with fixed shares, and None: retains that name no owner.
        a, b = (RetentionOwner(f"org:{n}", s) for n, s in zip("ab", owner_shares, strict=True))
        self.owners: list[RetentionOwner | None] = [a, b, None]
        self.owner_share = owner_share
        self.mgr = KVCacheManager(self.pool)
        self.open: list[tuple[Allocation, list[int]]] = []
        # Shadow state, independent of the pool's own bookkeeping:
        self.content: dict[int, tuple[int, ...]] = {}  # block id -> full token prefix it holds
        self.retained: dict[BlockHash, float] = {}  # hash -> deadline we were promised
        self.entry_blocks: dict[EntryKey, tuple[BlockHash, ...]] = {}
        self.charged: dict[BlockHash, str] = {}  # hash -> owner key its retention is charged to

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
    @rule(data=st.data(), ttl=st.sampled_from([300.0, 3600.0]), who=st.integers(0, 2))
    def retain(self, data: st.DataObject, ttl: float, who: int) -> None:
        hashes = data.draw(st.lists(st.sampled_from(sorted(self.pool.cached)), max_size=4))
        blocks = [self.pool.cached[h] for h in hashes]
        owner = self.owners[who]
        expected = self._fits(hashes, owner)
        result = self.pool.retain(blocks, ttl, owner)
        assert result.ok == expected, result.reason
        if result.ok:
            self._charge(hashes, owner, result.retained_until)

    @precondition(lambda self: any(a.state is AllocationState.COMMITTED for a, _ in self.open))
    @rule(data=st.data(), ttl=st.sampled_from([300.0, 3600.0]), who=st.integers(0, 2))
    def write_entry(self, data: st.DataObject, ttl: float, who: int) -> None:
        _alloc, toks = self._pick(data, AllocationState.COMMITTED)
        n = len(toks)
        hs = hash_blocks(toks, BLOCK)
        key = entry_key_at(toks, n, hs, BLOCK, ())
        covered = tuple(hs[: n // BLOCK])
        owner = self.owners[who]
        expected = all(h in self.pool.cached for h in covered) and self._fits(covered, owner)
        w = self.mgr.write_entry(key, n, hs, ttl, owner)
        assert w.written == expected, w.refused_reason
        if w.written:
            assert w.expires_at is not None
            # The entry may already live with a longer TTL: its blocks last as long.
            assert w.expires_at >= self.clock.now + ttl
            self.entry_blocks[key] = covered
            self._charge(covered, owner, w.expires_at)

    @precondition(lambda self: bool(self.entry_blocks))
    @rule(data=st.data())
    def lookup_entry(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.entry_blocks)))
        before = {h: self.retained.get(h, 0.0) for h in self.entry_blocks[key]}
        hit = self.mgr.lookup_entry([key])
        if hit is not None:
            # A live entry's blocks are retained at least as long as it lives, so a
            # hit only moves deadlines and never charges an owner anything new.
            assert all(d > self.clock.now for d in before.values())
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
        self.charged.clear()

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

    @invariant()
    def owner_counts_are_exact_and_within_quota(self) -> None:
        if not hasattr(self, "pool"):
            return
        owned = self.pool.retained_owners()
        assert owned == self._expected_owned()
        assert sum(owned.values()) == self.pool.counts().retained
        for owner in self.owners:
            if owner is not None:
                assert owned.get(owner.key, 0) <= self._quota(owner)

    # -------------------------------------------------------------- shadow

    def _live(self, h: BlockHash) -> bool:
        return self.retained.get(h, 0.0) > self.clock.now

    def _expected_owned(self) -> dict[str, int]:
        owned: dict[str, int] = {}
        for h, key in self.charged.items():
            if self._live(h):
                owned[key] = owned.get(key, 0) + 1
        return owned

    def _fits(self, hashes: Sequence[BlockHash], owner: RetentionOwner | None) -> bool:
        """Whether a retain must succeed, from the shadow alone: only blocks not retained
        yet count, against the pool's cap and (if below the cap) the owner's quota."""
        fresh = {h for h in hashes if not self._live(h)}
        if not fresh:
            return True
        owned = self._expected_owned()
        key = UNATTRIBUTED.key if owner is None else owner.key
        quota = self._quota(owner)
        total = sum(owned.values())
        within_quota = quota >= self.pool.max_retained or owned.get(key, 0) + len(fresh) <= quota
        return within_quota and total + len(fresh) <= self.pool.max_retained

    def _quota(self, owner: RetentionOwner | None) -> int:
        share = self.owner_share if owner is None or owner.share is None else owner.share
        return int(share * self.pool.max_retained + 1e-9)

    def _charge(
        self, hashes: Sequence[BlockHash], owner: RetentionOwner | None, deadline: float
    ) -> None:
        key = UNATTRIBUTED.key if owner is None else owner.key
        for h in hashes:
            if not self._live(h):
                self.charged[h] = key  # a block already retained stays with its first owner
            self.retained[h] = max(self.retained.get(h, 0.0), deadline)

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
