"""Random interleavings over a device pool with host and disk tiers behind it.

A shadow byte store runs every queued copy in order, so the machine checks what the
engine would read, not only the bookkeeping: every hittable block, in any tier, holds
exactly the tokens its hash names.
"""

from __future__ import annotations

import contextlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cachepoint.kvcore import (
    Allocation,
    AllocationState,
    BlockCopy,
    BlockHash,
    BlockPool,
    BlockStored,
    KVCacheManager,
    ManualClock,
    PoolExhaustedError,
    RetentionOwner,
    Tier,
    TierStore,
    entry_key_at,
    hash_blocks,
)

BLOCK = 2
FAMILIES = 4
MAX_LEN = 12


def _prompt(family: int, length: int, variant: int) -> list[int]:
    return [
        family * 1000 + i if i < 6 else family * 1000 + variant * 100 + i for i in range(length)
    ]


class TieredMachine(RuleBasedStateMachine):
    @initialize(
        device=st.integers(3, 10),
        host=st.integers(1, 8),
        disk=st.integers(0, 8),
        share=st.sampled_from([0.0, 0.5, 1.0]),
        owner_share=st.sampled_from([0.5, 1.0]),
    )
    def setup(self, device: int, host: int, disk: int, share: float, owner_share: float) -> None:
        self.clock = ManualClock(0.0)
        disk_store = (
            TierStore(
                Tier.DISK, disk, clock=self.clock, retained_share=share, owner_share=owner_share
            )
            if disk
            else None
        )
        self.host = TierStore(
            Tier.HOST,
            host,
            clock=self.clock,
            retained_share=share,
            owner_share=owner_share,
            lower=disk_store,
        )
        self.pool = BlockPool(
            device,
            BLOCK,
            retained_share=share,
            owner_share=owner_share,
            clock=self.clock,
            lower=self.host,
        )
        self.mgr = KVCacheManager(self.pool)
        self.open: list[tuple[Allocation, list[int]]] = []
        self.bytes: dict[tuple[Tier, int], tuple[int, ...]] = {}  # the shadow byte store
        self.tokens_of: dict[BlockHash, tuple[int, ...]] = {}  # hash -> the prefix it names
        self.retained: dict[BlockHash, float] = {}  # hash -> deadline promised
        self.lost: set[BlockHash] = set()  # retained hashes lost to an injected copy fault
        self.pins = 0  # lower-tier hits started, by our count
        self.lower_stored = 0  # lower-tier `stored` events seen

    # -------------------------------------------------------------- engine

    def _run(self, copies: list[BlockCopy]) -> None:
        for c in copies:
            src = self.bytes.get((c.src_tier, c.src_index))
            assert src is not None, f"copy from never-written {c.src_tier} {c.src_index}"
            assert src == self.tokens_of[c.block_hash], "copy source holds another block"
            self.bytes[(c.dst_tier, c.dst_index)] = src

    def _flush(self, fail: bool = False) -> bool:
        copies = self.mgr.take_copies()
        if fail and copies:
            for c in copies:
                if not c.is_promotion and self.retained.get(c.block_hash, 0.0) > self.clock.now:
                    self.lost.add(c.block_hash)
            self.mgr.finish_copies(copies, ok=False)
            return False
        self._run(copies)
        self.mgr.finish_copies(copies, ok=True)
        return True

    def _events(self) -> None:
        for e in self.mgr.take_events():
            if isinstance(e, BlockStored) and e.tier is not Tier.DEVICE:
                self.lower_stored += len(e.block_hashes)

    # --------------------------------------------------------------- rules

    @rule(
        family=st.integers(0, FAMILIES - 1),
        length=st.integers(1, MAX_LEN),
        variant=st.integers(0, 2),
        fail=st.booleans(),
    )
    def allocate(self, family: int, length: int, variant: int, fail: bool) -> None:
        toks = _prompt(family, length, variant)
        hs = hash_blocks(toks, BLOCK)
        for i, h in enumerate(hs):
            self.tokens_of[h] = tuple(toks[: (i + 1) * BLOCK])
        try:
            alloc = self.mgr.allocate(hs, length)
        except PoolExhaustedError:
            self._flush()
            return
        self.pins += alloc.num_promoted_blocks
        # The engine runs the copies before the forward; a fault aborts the request.
        if not self._flush(fail=fail and alloc.num_promoted_blocks > 0):
            alloc.abort()
            return
        for i, block in enumerate(alloc.blocks[: alloc.num_hit_blocks]):
            got = self.bytes.get((Tier.DEVICE, block.block_id))
            assert got == tuple(toks[: (i + 1) * BLOCK]), "a hit reads another prefix"
        self.open.append((alloc, toks))

    @precondition(lambda self: any(a.state is AllocationState.PENDING for a, _ in self.open))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        alloc, toks = self._pick(data, AllocationState.PENDING)
        # The forward wrote every computed block.
        for i, block in enumerate(alloc.blocks[alloc.num_hit_blocks :], alloc.num_hit_blocks):
            self.bytes[(Tier.DEVICE, block.block_id)] = tuple(toks[: (i + 1) * BLOCK])
        alloc.commit()

    @precondition(lambda self: any(a.state is AllocationState.PENDING for a, _ in self.open))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        alloc, _ = self._pick(data, AllocationState.PENDING)
        alloc.abort()
        self.open = [(a, t) for a, t in self.open if a is not alloc]

    @precondition(lambda self: any(a.state is AllocationState.COMMITTED for a, _ in self.open))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        alloc, _ = self._pick(data, AllocationState.COMMITTED)
        alloc.free()
        self.open = [(a, t) for a, t in self.open if a is not alloc]

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data(), extra=st.integers(1, 4), fail=st.booleans())
    def grow(self, data: st.DataObject, extra: int, fail: bool) -> None:
        alloc, _ = data.draw(st.sampled_from(self.open))
        with contextlib.suppress(PoolExhaustedError):
            alloc.grow(alloc.num_tokens + extra)
        self._flush(fail=fail)

    @precondition(lambda self: any(a.state is AllocationState.COMMITTED for a, _ in self.open))
    @rule(data=st.data(), ttl=st.sampled_from([300.0, 3600.0]), who=st.sampled_from("ab"))
    def write_entry(self, data: st.DataObject, ttl: float, who: str) -> None:
        _, toks = self._pick(data, AllocationState.COMMITTED)
        hs = hash_blocks(toks, BLOCK)
        key = entry_key_at(toks, len(toks), hs, BLOCK, ())
        w = self.mgr.write_entry(key, len(toks), hs, ttl, RetentionOwner(f"org:{who}"))
        if w.written:
            assert w.expires_at is not None
            for h in hs[: len(toks) // BLOCK]:
                self.retained[h] = max(self.retained.get(h, 0.0), w.expires_at)
                self.lost.discard(h)

    @rule(seconds=st.sampled_from([1.0, 299.0, 301.0, 3601.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def clear(self) -> None:
        self._flush()
        self.mgr.clear()
        self.retained.clear()
        self.lost.clear()

    # ---------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self._events()
        self.pool.check_invariants()  # also: no hash visible in two tiers

    @invariant()
    def every_visible_block_holds_its_tokens(self) -> None:
        if not hasattr(self, "pool"):
            return
        for h, block in self.pool.cached.items():
            assert self.bytes.get((Tier.DEVICE, block.block_id)) == self.tokens_of[h]
        for store in self.host:
            for h, slot in store._index.items():
                assert self.bytes.get((store.tier, slot.index)) == self.tokens_of[h], store.tier

    @invariant()
    def retained_blocks_are_never_lost(self) -> None:
        if not hasattr(self, "pool"):
            return
        now = self.clock.now
        for h, deadline in self.retained.items():
            if deadline > now and h not in self.lost:
                assert h in self.pool.cached or self.host.find(h) is not None, (
                    "a retained, unexpired block is visible in no tier"
                )

    @invariant()
    def counters_are_exact(self) -> None:
        if not hasattr(self, "pool"):
            return
        stats = self.mgr.stats().tiers
        assert sum(t.hits for t in stats) == self.pins
        assert sum(t.demotions for t in stats) == self.lower_stored
        for t in stats:
            assert t.visible <= t.used <= t.slots and t.retained <= t.max_retained

    def _pick(self, data: st.DataObject, state: AllocationState) -> tuple[Allocation, list[int]]:
        return data.draw(st.sampled_from([(a, t) for a, t in self.open if a.state is state]))

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for alloc, _ in self.open:
            alloc.close()
        self._flush()
        self.pool.check_invariants()
        assert self.pool.counts().active == 0
        assert all(s.pins == 0 for store in self.host for s in store.slots)


TieredMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_tiered_stateful = TieredMachine.TestCase
