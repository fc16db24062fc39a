"""The replica's scheduling policy: which requests the next engine step runs, on which
blocks, and what its sampled tokens mean for them.

Like vLLM's Scheduler, and unlike its busy loop (loop.py, vLLM's EngineCore): it is
synchronous, owns the kvcore pool, and knows the engine only by its shape. Each step,
`schedule()` grows the running sequences (preempting when the pool is full), admits
waiting ones and returns a `StepPlan`; `update()` takes the step's sampled tokens and
returns a `StepUpdate`; the loop runs the one and delivers the other. It imports
neither torch nor asyncio (tests/replica/test_policy.py checks), so every decision
here is unit-tested on kvcore's pool alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from cachepoint.kvcore import (
    EVICTION_POLICIES,
    Allocation,
    BlockHash,
    BlockPool,
    KVCacheManager,
    PoolExhaustedError,
    Tier,
    TierStore,
    hash_blocks,
    monotonic_clock,
)
from cachepoint.protocol import CacheReport
from cachepoint.replica import admission
from cachepoint.replica.errors import OverloadedError, failed_inside
from cachepoint.replica.request_queue import RequestQueue
from cachepoint.replica.request_state import RequestState, SeqStatus
from cachepoint.replica.step import (
    Admitted,
    DecodeChunk,
    Ending,
    Note,
    Preemption,
    PrefillChunk,
    Sampled,
    StepPlan,
    StepUpdate,
)

log = logging.getLogger(__name__)

R = TypeVar("R", bound=RequestState)


class PolicySettings(Protocol):
    """The settings the policy reads (a `ReplicaSettings` has them all)."""

    name: str  # the replica's, for logs and errors
    max_num_seqs: int  # sequences running at once
    max_num_batched_tokens: int  # tokens in one step
    decode_steps: int  # decode steps one engine call may run back to back
    decode_reserve_blocks: int  # decode headroom reserved at admission
    readmit_headroom_tokens: int  # free room per running sequence a readmission needs
    max_admission_bypass: int  # admissions past a request that does not fit, at most
    coalesce_prefills: bool  # a request waits for another's prefill of its prefix
    retained_share: float  # share of the pool TTL retention may hold
    org_retained_share: float  # share of that one tenant may hold
    eviction: str  # kvcore's eviction policy, by name


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What the policy knows of an engine: the geometry of its KV pool and tiers."""

    block_size: int  # tokens per KV block
    num_blocks: int  # device blocks the pool manages
    host_blocks: int = 0  # host-tier slots the engine allocated (0: no tiers)
    disk_blocks: int = 0  # disk-tier slots behind the host tier (0: none)


def _keep(seq_id: int) -> None:
    """The default `forget`: an engine that keeps nothing per sequence."""


class SchedulerPolicy(Generic[R]):
    """Owns the kvcore pool, the waiting queue and the running batch.

    ``forget`` is called with a sequence's ``arrival`` whenever its blocks go back, so
    the engine drops what it kept of that sequence (its cached block table).
    """

    def __init__(
        self,
        shape: EngineShape,
        settings: PolicySettings,
        *,
        clock: Callable[[], float] = monotonic_clock,
        forget: Callable[[int], None] = _keep,
    ) -> None:
        self.settings = settings
        self.name = settings.name
        self.block_size = shape.block_size
        self.pool = BlockPool(
            shape.num_blocks,
            shape.block_size,
            retained_share=settings.retained_share,
            owner_share=settings.org_retained_share,
            clock=clock,
            eviction=EVICTION_POLICIES[settings.eviction](),
            lower=_lower_tiers(shape, settings, clock),
        )
        self.manager = KVCacheManager(self.pool)
        self.waiting: RequestQueue[R] = RequestQueue()  # by priority, then arrival
        self.running: list[R] = []  # admitted, in admission order
        self.preemptions = 0  # running sequences requeued to recompute, ever
        self._forget = forget
        self._notes: list[Note[R]] = []  # since the last plan, for the loop

    # ---------------------------------------------------------------- intake

    def add(self, seq: R) -> None:
        """Queue a validated request at its rank."""
        self.waiting.add(seq)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill work not yet done: what the router's load penalty weighs."""
        waiting = sum(s.prefill_len for s in self.waiting)
        return waiting + sum(s.remaining_prefill for s in self.running if s.plan is not None)

    # ------------------------------------------------------------------ step

    def schedule(self, *, multi_step: bool = True) -> StepPlan[R]:
        """The next step: growth, then admission, then the batch and its tier copies.

        ``multi_step=False`` keeps the step to one decode (the loop's fault hook must
        see every step).
        """
        # NOTE: growth first, so running sequences get the blocks before newcomers;
        # and no admission in a round that preempted, or the victim (back in the
        # queue) would take back the blocks it just gave up.
        if not self.grow():
            self.admit()
        plan = self._batch()
        # NOTE: before the copies are taken: the blocks a run of steps needs may evict
        # cached ones, whose demotions must be copied before the run overwrites them.
        plan.decode_steps = self._decode_steps(plan) if multi_step else 1
        plan.copies = self.manager.take_copies()
        plan.notes = self.take_notes()
        return plan

    def update(self, plan: StepPlan[R], sampled: Sampled) -> StepUpdate[R]:
        """One step of ``plan`` ran and sampled ``sampled``: advance its prefills, and
        pair each sampled row (the prefills it completed, then the decodes) with its
        token. A multi-step plan is updated once per step it ran."""
        size = len(plan.prefills) + len(plan.decodes)
        prefilled: list[R] = []
        for chunk in plan.prefills:
            seq = chunk.seq
            seq.max_batch = max(seq.max_batch, size)
            seq.num_computed = chunk.end
            if chunk.samples:
                prefilled.append(seq)
        rows = prefilled + [c.seq for c in plan.decodes]
        tokens = [sampled] * len(rows) if isinstance(sampled, Exception) else sampled
        return StepUpdate(prefilled, list(zip(rows, tokens, strict=True)))

    def take_notes(self) -> list[Note[R]]:
        """What the policy did to requests since the last plan (or the last call)."""
        notes, self._notes = self._notes, []
        return notes

    # ----------------------------------------------------------------- commit

    def commit(self, seq: R) -> int:
        """``seq``'s prefill succeeded: write, then publish. Its full blocks enter the
        index, then the entries past the hit are written and the cache report is
        final. Returns how many blocks entered the index."""
        assert seq.alloc is not None
        assert seq.plan is not None
        promoted = seq.alloc.num_promoted_blocks
        if seq.cache is not None:
            # NOTE: a recompute after a preemption: the report and `prefill_done` went
            # out at the first commit and stand (billed once); entries were written then.
            seq.alloc.commit()
            seq.status = SeqStatus.DECODING
            return 0
        stored = seq.alloc.commit()
        admission.write_entries(self.manager, seq.plan)
        w5m, w1h = admission.written_tokens(seq.plan)
        hit = seq.alloc.num_cached_tokens
        seq.cache = CacheReport(
            prompt_tokens=seq.prompt_len,
            engine_hit_tokens=hit,
            computed_tokens=seq.prompt_len - hit,
            entry_hit_tokens=seq.plan.entry_hit_tokens,
            entry_hit_lookback=seq.plan.entry_hit_lookback,
            written_5m_tokens=w5m,
            written_1h_tokens=w1h,
            retention_refused=seq.plan.refusal_reason is not None,
            refusal_reason=seq.plan.refusal_reason,
            promoted_tokens=promoted * self.block_size,
        )
        seq.status = SeqStatus.DECODING
        return stored

    def finish(self, seq: R, *, keep_output: bool = False) -> None:
        """Take ``seq`` out of scheduling: its blocks go back (aborted if its prefill
        never committed, else freed) and it leaves the queue or the batch.

        ``keep_output``: a turn that ended well publishes the full blocks of its answer
        first, so the next turn, whose prompt repeats this one and its answer, reuses
        them instead of recomputing (vLLM caches decode blocks the same way). They are
        reused for speed and billed as input: no entry covers them.
        """
        if seq.alloc is not None:
            if keep_output and seq.cache is not None and seq.output:
                self._publish_progress(seq)
            seq.alloc.close()
            self._forget(seq.arrival)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _end(self, seq: R, error: Exception | None) -> None:
        """The policy itself ends ``seq``; the loop delivers the ending."""
        self.finish(seq)
        self._notes.append(Ending(seq, error))

    def _fail(self, seq: R, exc: Exception) -> None:
        """Something raised while handling ``seq``: it fails alone, the rest goes on."""
        if seq.status is SeqStatus.FINISHED:
            return
        log.error("request %s failed inside the replica", seq.request_id, exc_info=exc)
        self._end(seq, failed_inside(self.name, exc))

    # ------------------------------------------------------------- admission

    def admit(self) -> None:
        """Admission in queue order (priority, then arrival) while sequences and blocks
        allow, without head-of-line blocking.

        NOTE: admission reserves the prompt plus `decode_reserve_blocks` (never less
        than the first decode's slot), not prompt + max_tokens: a `max_tokens: 32000`
        must not hold 32,000 tokens of KV it may never use. Running sequences grow one
        block at a time in `grow`, which preempts the lowest-priority one when full.

        NOTE: a request whose blocks do not fit is passed over, and later ones that fit
        still run (a small request must not wait behind a large one). Each admission
        past it counts; at `max_admission_bypass` nothing more goes past it until it
        fits, so a large request is delayed a bounded amount, never starved.
        """
        limit = self.settings.max_admission_bypass
        blocked: list[R] = []  # passed over in this round, in queue order
        # NOTE: only when something waits: admit() runs every step.
        inflight = self._inflight_blocks() if self.waiting else set()
        for seq in list(self.waiting):
            if len(self.running) >= self.settings.max_num_seqs:
                return
            if seq.status is SeqStatus.FINISHED:
                continue  # failed by an earlier admission in this round
            if blocked and self.running and not len(self.pool.free_queue):
                return  # nothing free: no later request can fit either
            if inflight and self._wait_for_prefill(seq, inflight):
                continue  # its prefix is being computed by another request: hit it next
            try:
                if not self._admit_one(seq):
                    if seq.bypassed >= limit:
                        return
                    blocked.append(seq)
                    continue
            except Exception as exc:  # a plan that raised: this request only
                self._fail(seq, exc)
                continue
            if self.settings.coalesce_prefills and seq.plan is not None:
                # NOTE: admitted in this very round: the rest of the herd waits for it.
                inflight.update(self._uncached(seq.plan.block_hashes))
            for b in blocked:
                b.bypassed += 1
            if any(b.bypassed >= limit for b in blocked):
                return

    def _inflight_blocks(self) -> set[BlockHash]:
        """Prompt blocks that running requests are prefilling now and will publish when
        they commit (not yet in the prefix index)."""
        if not self.settings.coalesce_prefills:
            return set()
        return {
            h
            for s in self.running
            if s.status is SeqStatus.PREFILLING and s.plan is not None
            for h in self._uncached(s.plan.block_hashes)
        }

    def _uncached(self, hashes: list[BlockHash]) -> list[BlockHash]:
        cached = self.pool.cached
        return [h for h in hashes if h not in cached]

    def _wait_for_prefill(self, seq: R, inflight: set[BlockHash]) -> bool:
        """Should ``seq`` wait for another request's prefill of its own prefix?

        NOTE: the first-turn herd: agents that start together send the same static
        prefix at once. Admitted together, each computes it; vLLM avoids that because
        it indexes a block when it schedules the forward that fills it. Here a block is
        published when its request commits, so a request whose next uncached block is
        one another request is computing waits (stays queued) until that request
        commits, then hits it. Keys are part of the hashes, so only requests that may
        share a prefix ever wait for each other.
        """
        if seq.cache is not None:
            return False  # a readmission after preemption: its own blocks, resume_hashes
        if seq.prompt_hashes is None:
            schedule = admission.key_schedule(seq.key_spans)
            seq.prompt_hashes = hash_blocks(seq.prompt, self.block_size, schedule)
        cached = self.pool.cached
        for h in seq.prompt_hashes:
            if h in cached:
                continue
            if h in inflight:
                seq.coalesced += 1
                return True
            return False
        return False

    def _admit_one(self, seq: R) -> bool:
        """Admit ``seq`` from the waiting queue (or end it); False when it must wait
        for blocks."""
        resumed = seq.cache is not None  # committed once, preempted since: recompute
        n = seq.prefill_len
        # Token slots it can ever use: the last sampled token is never fed back.
        cap = seq.prompt_len + seq.max_tokens - 1
        least = max(n, min(n + 1, cap))  # up to the first decode's slot
        want = max(least, min(cap, n + self.settings.decode_reserve_blocks * self.block_size))
        if self.running and not self._may_fit(seq, want, resumed):
            # NOTE: a cheap bound first: a request that cannot fit is otherwise planned
            # (its prompt hashed), allocated and aborted again every step it waits.
            return False
        if resumed and seq.plan is not None:
            # NOTE: the first admission's plan stands: re-planning would look entries
            # up again, and the cache report (what is billed) is the first admission's.
            cp = seq.plan
        else:
            schedule = admission.key_schedule(seq.key_spans)
            cp = admission.plan(
                self.manager, seq.prompt, schedule, seq.entry_spans, seq.prompt_hashes
            )
        hashes = seq.resume_hashes if resumed and seq.resume_hashes else cp.block_hashes
        if resumed and self.running and not self._headroom_before(hashes, n, want):
            return False
        try:
            alloc = self._allocate(hashes, n, want)
        except PoolExhaustedError as exc:
            if self.running:
                return False
            try:
                # NOTE: alone, it is admitted with the least it can run on rather than
                # turned away; if the pool stays full it ends at `max_tokens` (grow).
                alloc = self._allocate(hashes, n, least)
            except PoolExhaustedError:
                # Nothing will free blocks: what is held is retained by TTL.
                self._end(seq, OverloadedError(f"KV pool is full: {exc}"))
                return True
        if resumed and self.running and not self._headroom_after():
            # NOTE: readmitting now would only recompute it to preempt it again a few
            # steps later (each time costing its whole context): wait for room.
            alloc.abort()
            return False
        self.waiting.remove(seq)
        seq.bypassed = 0
        seq.plan, seq.alloc = cp, alloc
        seq.num_computed = alloc.num_cached_tokens
        seq.status = SeqStatus.PREFILLING
        self.running.append(seq)
        if not resumed:
            seq.t_admit = time.perf_counter()
        if alloc.num_promoted_blocks:
            seq.promoting = True
        self._notes.append(Admitted(seq, resumed, cp, alloc))
        return True

    def _may_fit(self, seq: R, slots: int, resumed: bool) -> bool:
        """Whether ``slots`` token slots could be had at all: the free blocks plus as
        many cache hits as the prompt has full blocks and the pool has cached blocks
        (an upper bound), and for a readmission the headroom too."""
        hits = min(seq.prefill_len // self.block_size, self.pool.num_cached_blocks)
        need = -(-slots // self.block_size) - hits
        if resumed:
            per_seq = -(-self.settings.readmit_headroom_tokens // self.block_size)
            need += per_seq * (len(self.running) + 1)
        free = len(self.pool.free_queue)
        if self.pool.lower is not None:
            free += self.pool.counts().retained  # retained blocks may move down a tier
        return free >= need

    def _headroom_before(self, hashes: list[BlockHash], n: int, slots: int) -> bool:
        """`_headroom_after`, predicted before allocating: only device hits save blocks.

        NOTE: checked first so that a readmission that must wait neither queues
        promotion copies for blocks it hands back at once nor counts them as hits.
        """
        m = self.manager.match(hashes, n)
        need = -(-slots // self.block_size) - (m.num_blocks - m.lower_blocks)
        per_seq = -(-self.settings.readmit_headroom_tokens // self.block_size)
        return len(self.pool.free_queue) - need >= per_seq * (len(self.running) + 1)

    def _headroom_after(self) -> bool:
        """Whether the free blocks cover `readmit_headroom_tokens` of growth for every
        running sequence plus the one being readmitted."""
        per_seq = -(-self.settings.readmit_headroom_tokens // self.block_size)
        return len(self.pool.free_queue) >= per_seq * (len(self.running) + 1)

    def _allocate(self, hashes: list[BlockHash], n: int, slots: int) -> Allocation:
        """Hit the cached prefix of ``hashes`` (the prompt's, or for a readmission the
        prompt's and its output's), then blocks for ``slots`` token slots in all."""
        alloc = self.manager.allocate(hashes, n)
        try:
            alloc.grow(slots)
        except PoolExhaustedError:
            alloc.abort()
            raise
        return alloc

    # ------------------------------------------------------ growth, preemption

    def grow(self) -> bool:
        """Give each decoding sequence, in queue order (priority, then arrival), the
        slot its next step writes and one more; when the pool is full, preempt the
        lowest-priority running sequence, the newest among equals (vLLM's recompute
        preemption). Returns whether anything was preempted.

        NOTE: the slot one ahead is what lets a sequence the pool cannot grow end with
        a final token event (which flushes held-back text) rather than after one.
        """
        preempted = False
        for seq in sorted(self.running, key=lambda q: q.rank):
            if seq.status is not SeqStatus.DECODING or seq.context_full:
                continue  # preempted in this loop already, prefilling, or at its end
            try:
                preempted |= self._grow_one(seq)
            except Exception as exc:
                self._fail(seq, exc)
        return preempted

    def _grow_one(self, seq: R) -> bool:
        assert seq.alloc is not None
        k = len(seq.output)
        need = seq.prompt_len + k  # slots once the next decode wrote its token
        # One slot ahead unless the token this step samples is the last anyway.
        want = min(need + 1, seq.prompt_len + seq.max_tokens - 1)
        preempted = False
        while True:
            try:
                seq.alloc.grow(max(want, need))
                return preempted
            except PoolExhaustedError:
                if len(self.running) == 1:
                    break
            victim = max(self.running, key=lambda q: q.rank)
            self.preempt(victim)
            preempted = True
            if victim is seq:
                return True
        # Alone and the pool is full (what else is held is retained by TTL): the
        # context is full, so it ends like a length stop, not with an error.
        try:
            seq.alloc.grow(need)
        except PoolExhaustedError:
            seq.stop_reason = "max_tokens"  # NOTE: unreachable while admission keeps `least`
            self._end(seq, None)
        else:
            seq.context_full = True
        return preempted

    def _publish_progress(self, seq: R) -> None:
        """Publish every full block ``seq`` has computed, output included, before its
        blocks go back: its readmission then hits them (on the device, or promoted
        from the host tier if they were demoted meanwhile) instead of recomputing.

        NOTE: this turns recompute preemption into swapping wherever a lower tier has
        room; without one it still saves whatever the device has not evicted yet.
        """
        assert seq.alloc is not None and seq.plan is not None
        # The last sampled token has not been fed yet: KV exists up to the one before.
        computed = seq.prompt + seq.output[:-1]
        full = len(computed) // self.block_size
        schedule = admission.key_schedule(seq.key_spans)
        try:
            hashes = hash_blocks(computed[: full * self.block_size], self.block_size, schedule)
            seq.alloc.commit(hashes)
        except Exception:  # an optimisation only: the recompute still works without it
            log.exception("could not publish the progress of %s", seq.request_id)
            return
        seq.resume_hashes = hashes

    def preempt(self, seq: R) -> None:
        """Return ``seq``'s blocks and requeue it at its rank to recompute later: ahead
        of everything that arrived after it at its priority.

        Its published prompt blocks stay in the prefix cache (cached-free, evictable
        like any others), so the recompute usually hits them. Nothing is streamed again:
        the recompute prefills the prompt plus the output so far and samples on from it.
        """
        assert seq.alloc is not None
        committed = seq.cache is not None
        if committed:
            self._publish_progress(seq)
        seq.alloc.close()  # abort if the prefill never committed, else free
        seq.alloc = None
        self._forget(seq.arrival)  # its next admission gets other blocks
        if committed:
            seq.recompute = len(seq.output)
        else:
            # NOTE: before its first commit nothing was reported or streamed: it starts
            # over as a fresh admission (a new plan, a new cache report).
            seq.plan = None
        self._notes.append(Preemption(seq, committed, seq.num_computed))
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        self.waiting.add(seq)
        log.info(
            "preempted %s after %d tokens",
            seq.request_id,
            len(seq.output),
            extra={"fields": {"event": "preempted", "replica": self.name}},
        )

    # ----------------------------------------------------------------- batch

    def _batch(self) -> StepPlan[R]:
        """Decodes first (one token each), then prefill chunks in the remaining budget,
        so a long prompt never stalls the sequences that are already generating."""
        plan: StepPlan[R] = StepPlan()
        budget = self.settings.max_num_batched_tokens
        for seq in self.running:
            if seq.status is SeqStatus.DECODING:
                assert seq.alloc is not None
                pos = seq.prompt_len + len(seq.output) - 1
                plan.decodes.append(DecodeChunk(seq, seq.output[-1], pos, seq.alloc.block_ids))
        budget -= len(plan.decodes)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.status is SeqStatus.PREFILLING:
                assert seq.alloc is not None
                chunk = min(seq.remaining_prefill, budget)
                end = seq.num_computed + chunk
                plan.prefills.append(
                    PrefillChunk(
                        seq, seq.num_computed, end, seq.alloc.block_ids, end == seq.prefill_len
                    )
                )
                budget -= chunk
        return plan

    def _decode_steps(self, plan: StepPlan[R]) -> int:
        """How many decode steps to run back to back for ``plan`` (1: just this one).

        NOTE: vLLM's multi-step scheduling: only a decode-only batch with nothing
        waiting and no cancellation pending, and only as many steps as every sequence
        may still take (its ``max_tokens``) with the slots for them already in its
        blocks. A pool that cannot give them without preempting anyone means one
        step, as before.
        """
        k = self.settings.decode_steps
        if k <= 1 or not plan.decodes or plan.prefills or self.waiting:
            return 1
        for chunk in plan.decodes:
            seq = chunk.seq
            if seq.cancelled or seq.context_full:
                return 1
            k = min(k, seq.max_tokens - len(seq.output))
        if k <= 1:
            return 1
        for chunk in plan.decodes:
            seq = chunk.seq
            assert seq.alloc is not None
            need = seq.prompt_len + len(seq.output) + k - 1  # slots the k steps write
            # One slot ahead as `grow` keeps, unless the last of them samples the last.
            want = min(need + 1, seq.prompt_len + seq.max_tokens - 1)
            try:
                seq.alloc.grow(max(need, want))
            except PoolExhaustedError:
                return 1
        return k


def _lower_tiers(
    shape: EngineShape, settings: PolicySettings, clock: Callable[[], float]
) -> TierStore | None:
    """The host tier (and the disk tier behind it) the engine allocated, if any."""
    if not shape.host_blocks:
        return None

    def store(tier: Tier, slots: int, lower: TierStore | None = None) -> TierStore:
        return TierStore(
            tier,
            slots,
            retained_share=settings.retained_share,
            owner_share=settings.org_retained_share,
            clock=clock,
            lower=lower,
        )

    disk = store(Tier.DISK, shape.disk_blocks) if shape.disk_blocks else None
    return store(Tier.HOST, shape.host_blocks, disk)
