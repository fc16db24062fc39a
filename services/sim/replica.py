"""One simulated replica: a real kvcore pool, a prefill queue, and the load it reports."""

from __future__ import annotations

from collections import deque
from typing import Any

from cachepoint.kvcore import (
    EVICTION_POLICIES,
    Allocation,
    BlockCopy,
    BlockPool,
    Clock,
    EvictionPolicy,
    KVCacheManager,
    PoolExhaustedError,
    PrefixIndex,
    Tier,
    TierStore,
)
from cachepoint.routing import ReplicaView
from cachepoint.sim.content import PreparedRequest
from cachepoint.sim.cost import ReplicaCostModel
from cachepoint.sim.links import LinkSchedule
from cachepoint.sim.result import ReplicaStats
from cachepoint.sim.trace import TraceBreakpoint, TraceRequest


def make_eviction(name: str, **options: Any) -> EvictionPolicy:
    """A kvcore eviction strategy by its EVICTION_POLICIES name ("lru", "hit_density", ...)."""
    cls = EVICTION_POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown eviction {name!r}; choose from {', '.join(EVICTION_POLICIES)}")
    policy: EvictionPolicy = cls(**options)
    return policy


def lower_tiers(
    host_slots: int, disk_slots: int, *, clock: Clock, retained_share: float
) -> TierStore | None:
    """The tiers behind a device pool: host, then disk; either may be absent (0 slots)."""
    disk = (
        TierStore(Tier.DISK, disk_slots, retained_share=retained_share, clock=clock)
        if disk_slots
        else None
    )
    if not host_slots:
        return disk
    return TierStore(Tier.HOST, host_slots, retained_share=retained_share, clock=clock, lower=disk)


class Job:
    """One request on its way through a replica."""

    __slots__ = (
        "alloc",
        "arrival",
        "breakpoints",
        "est_prefill",
        "hit_tokens",
        "index",
        "input_length",
        "output_length",
        "prep",
        "promote_s",
        "promoted",
        "read_tokens",
        "req",
    )

    def __init__(
        self,
        index: int,
        arrival: float,
        req: TraceRequest,
        prep: PreparedRequest,
        breakpoints: tuple[TraceBreakpoint, ...],
    ) -> None:
        self.index = index  # position in the trace
        self.arrival = arrival  # simulated arrival time, seconds
        self.req = req  # the trace request
        self.prep = prep  # its hashes
        self.breakpoints = breakpoints  # markers in effect under the run's retention mode
        self.input_length = req.input_length  # prompt tokens
        self.output_length = req.output_length  # generated tokens
        self.est_prefill = 0  # prefill tokens the replica expected at enqueue (its reported load)
        self.alloc: Allocation | None = None  # its blocks, from admission to finish
        self.hit_tokens = 0  # prompt tokens the pool served at admission
        self.read_tokens = 0  # tokens billed as a cache read
        self.promoted: dict[Tier, int] = {}  # hit blocks promoted from a lower tier, by tier
        self.promote_s = 0.0  # seconds its prefill waited for those promotions


class SimReplica:
    """A replica's scheduler reduced to what decides hits, queueing and load."""

    __slots__ = (
        "busy_s",
        "cached_tokens",
        "context_tokens",
        "decoding",
        "hit_blocks",
        "links",
        "manager",
        "pending",
        "pool",
        "prefill_end",
        "prefill_start",
        "prefill_tokens",
        "prefilling",
        "queued_waiting",
        "requests",
        "view",
        "waiting",
    )

    def __init__(
        self,
        name: str,
        num_blocks: int,
        block_size: int,
        *,
        clock: Clock,
        retained_share: float,
        eviction: EvictionPolicy,
        max_waiting: int | None = None,
        host_slots: int = 0,
        disk_slots: int = 0,
        cost: ReplicaCostModel | None = None,
    ) -> None:
        lower = lower_tiers(host_slots, disk_slots, clock=clock, retained_share=retained_share)
        self.pool = BlockPool(
            num_blocks,
            block_size,
            retained_share=retained_share,
            clock=clock,
            eviction=eviction,
            lower=lower,
        )
        self.manager = KVCacheManager(self.pool)  # the scheduler's façade over the pool
        self.view = ReplicaView(name, PrefixIndex(), max_waiting=max_waiting)  # the router's view
        self.waiting: deque[Job] = deque()  # routed here, not yet admitted (FCFS)
        self.prefilling: Job | None = None  # the one request in prefill
        self.prefill_start = 0.0  # when that prefill began
        self.prefill_end = 0.0  # when it will finish
        self.queued_waiting = 0  # expected prefill tokens of the waiting requests
        self.decoding = 0  # requests in decode
        self.context_tokens = 0  # KV tokens the decode batch reads per step
        self.requests = 0  # requests admitted, ever
        self.prefill_tokens = 0  # tokens computed in prefill, ever
        self.cached_tokens = 0  # prompt tokens served from the pool, ever
        self.busy_s = 0.0  # seconds of prefill, ever
        cost = cost or ReplicaCostModel()
        self.links = LinkSchedule(cost, cost.block_bytes(block_size))  # its copy links
        # copy batches handed to the "engine" and not yet finished: (done at, copies)
        self.pending: deque[tuple[float, list[BlockCopy]]] = deque()
        self.hit_blocks: dict[Tier, int] = dict.fromkeys(Tier, 0)  # kvcore blocks hit, by tier

    @property
    def idle(self) -> bool:
        """Nothing in prefill or decode, so nothing will free blocks."""
        return self.prefilling is None and self.decoding == 0

    def enqueue(self, job: Job) -> None:
        """Queue a routed request; its expected prefill joins the reported load."""
        matched = self.manager.match(job.prep.block_hashes, job.input_length).num_tokens
        job.est_prefill = job.input_length - matched
        self.waiting.append(job)
        self.view.waiting += 1
        self.queued_waiting += job.est_prefill
        self.view.queued_prefill_tokens += job.est_prefill

    def refresh_load(self, now: float) -> None:
        """Report queued prefill work as a scheduler does: the waiting requests' expected
        tokens plus what is left of the prefill in progress."""
        queued = self.queued_waiting
        job = self.prefilling
        if job is not None and self.prefill_end > self.prefill_start:
            left = (self.prefill_end - now) / (self.prefill_end - self.prefill_start)
            queued += int(job.est_prefill * min(max(left, 0.0), 1.0))
        self.view.queued_prefill_tokens = queued

    def settle(self, now: float | None = None) -> bool:
        """Finish the copy batches done by ``now`` (every one if None); True if any finished.

        NOTE: a demoted block becomes hittable in its tier only here, when its copy
        has completed (write-then-publish). A replica's engine runs a batch's copies
        before its next forward, so every batch is finished before the next
        allocation at the latest.
        """
        pending = self.pending
        done = False
        while pending and (now is None or pending[0][0] <= now):
            _, copies = pending.popleft()
            self.manager.finish_copies(copies, ok=True)
            done = True
        return done

    def _copies(self, now: float) -> tuple[float, float]:
        """Hand the manager's queued copies to the links; (promotions done, demotions done)."""
        copies = self.manager.take_copies()
        if not copies:
            return now, now
        timing = self.links.schedule(copies, now)
        self.pending.append((max(timing.promoted_at, timing.demoted_at), copies))
        return timing.promoted_at, timing.demoted_at

    def start(self, job: Job, now: float) -> int | None:
        """Admit the queue's head: hit, allocate prompt and output slots. None if it cannot fit.

        Sets ``job.promote_s``, how long the prefill must wait for the promotions of its
        lower-tier hits (behind any copies already queued on the same links).
        """
        self.settle()
        try:
            alloc = self.manager.allocate(job.prep.block_hashes, job.input_length)
        except PoolExhaustedError:
            return None
        if job.output_length:
            try:
                alloc.grow(job.input_length + job.output_length)
            except PoolExhaustedError:
                alloc.abort()
                self._copies(now)  # the demotions it made still run
                return None
        promoted_at, _ = self._copies(now)
        job.promote_s = promoted_at - now
        job.promoted = dict(alloc.promoted_by_tier)
        promoted = alloc.num_promoted_blocks
        self.hit_blocks[Tier.DEVICE] += alloc.num_hit_blocks - promoted
        for tier, n in alloc.promoted_by_tier.items():
            self.hit_blocks[tier] += n
        self.waiting.popleft()
        self.queued_waiting -= job.est_prefill
        self.view.waiting -= 1
        self.view.running += 1
        self.prefilling = job
        self.prefill_start = self.prefill_end = now
        job.alloc = alloc
        job.hit_tokens = alloc.num_cached_tokens
        self.requests += 1
        self.cached_tokens += job.hit_tokens
        self.prefill_tokens += job.input_length - job.hit_tokens
        return job.hit_tokens

    def drop_head(self) -> Job:
        job = self.waiting.popleft()
        self.queued_waiting -= job.est_prefill
        self.view.waiting -= 1
        self.view.queued_prefill_tokens -= job.est_prefill
        return job

    def commit(self, job: Job) -> None:
        """Prefill succeeded: publish its blocks, move it to decode."""
        assert job.alloc is not None
        job.alloc.commit()
        self.prefilling = None
        self.view.queued_prefill_tokens -= job.est_prefill
        self.decoding += 1
        # NOTE: a sequence's context grows during decode; half its output is its
        # average share of the batch's KV reads.
        self.context_tokens += job.input_length + job.output_length // 2

    def finish(self, job: Job) -> None:
        """Decode finished: return its blocks, chain tail first."""
        assert job.alloc is not None
        job.alloc.free()
        job.alloc = None
        self.decoding -= 1
        self.view.running -= 1
        self.context_tokens -= job.input_length + job.output_length // 2

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            name=self.view.name,
            requests=self.requests,
            prefill_tokens=self.prefill_tokens,
            cached_tokens=self.cached_tokens,
            busy_s=self.busy_s,
            evictions=self.pool.num_evictions,
            indexed_blocks=len(self.view.index),
        )
