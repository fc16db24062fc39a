"""The discrete-event replay: N replicas of real kvcore pools behind a real routing policy.

Time is the trace's, times ``time_scale``; one `ManualClock` drives every pool, so
TTL retention runs on simulated seconds. Each replica prefills one request at a
time (FCFS) and decodes concurrently. Its pool emits kvcore events, which reach
the router's per-replica `PrefixIndex` (after ``event_delay_s``), exactly the path
the gateway uses. The router only ever sees those indexes and the load the
replicas report.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachepoint.kvcore import (
    TTL_SECONDS,
    BlockRemoved,
    BlockStored,
    EntryKey,
    EvictionPolicy,
    KVEvent,
    ManualClock,
    entry_key,
)
from cachepoint.routing import NoReplicaError, RoutingPolicy, make_policy, tier_value
from cachepoint.sim.billing import PriceTable, Usage, usage_for
from cachepoint.sim.bound import CacheBound, infinite_cache_bound
from cachepoint.sim.content import PreparedRequest, TraceHasher
from cachepoint.sim.cost import ReplicaCostModel
from cachepoint.sim.links import LINKS
from cachepoint.sim.oracle import NextUseTable, OracleEviction
from cachepoint.sim.replica import Job, SimReplica, make_eviction
from cachepoint.sim.result import SimResult, percentile
from cachepoint.sim.trace import Trace, TraceBreakpoint, TraceRequest

RETENTION_MODES = ("none", "trace", "5m", "1h")  # --retention choices
ProgressFn = Callable[[int, int], None]  # (requests done, requests total)
WireFn = Callable[["SimReplica", Sequence[KVEvent]], Sequence[KVEvent]]
"""What kv events go through between a pool and the router (e.g. encode, then decode)."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One configuration to replay."""

    replicas: int = 16  # replicas in the fleet
    capacity_frac: float = 0.01  # per replica, share of the trace's distinct blocks
    capacity_blocks: int | None = None  # per replica in kvcore blocks; overrides capacity_frac
    host_frac: float = 0.0  # host tier per replica, share of the distinct blocks (0: none)
    disk_frac: float = 0.0  # disk tier per replica, share of the distinct blocks (0: none)
    block_size: int | None = None  # kvcore tokens per block; None: the trace's block size
    policy: str = "cache_aware"  # routing policy name (cachepoint.routing.make_policy)
    policy_options: dict[str, Any] = field(default_factory=dict)  # its keyword arguments
    eviction: str = "lru"  # pool eviction: a kvcore EVICTION_POLICIES name, or "oracle" (reference)
    eviction_options: dict[str, Any] = field(default_factory=dict)  # its keyword arguments
    retention: str = "none"  # "none", "trace" (its breakpoints), "5m"/"1h" (whole prompt)
    retained_share: float = 0.5  # cap on TTL-retained blocks per pool
    min_cacheable_tokens: int = 1024  # shorter prompts are never written nor billed as cache
    time_scale: float = 1.0  # multiplies every arrival time (0.5 = twice the rate)
    event_delay_s: float = 0.0  # kv events reach the router this much later
    max_waiting: int | None = None  # per-replica queue bound the router respects
    seed: int = 0  # seeds every random choice
    cost: ReplicaCostModel = field(default_factory=ReplicaCostModel)  # prefill/decode times
    prices: PriceTable = field(default_factory=PriceTable)  # the bill

    def __post_init__(self) -> None:
        if self.replicas <= 0:
            raise ValueError("replicas must be positive")
        if self.capacity_blocks is None and not self.capacity_frac > 0:
            raise ValueError("capacity_frac must be positive")
        if self.capacity_blocks is not None and self.capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        for name in ("host_frac", "disk_frac"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative share, got {value}")
        if self.retention not in RETENTION_MODES:
            raise ValueError(f"retention must be one of {', '.join(RETENTION_MODES)}")
        if not self.time_scale > 0:
            raise ValueError("time_scale must be positive")
        if self.event_delay_s < 0:
            raise ValueError("event_delay_s must be non-negative")


@dataclass(slots=True)
class PreparedTrace:
    """A trace with its hashes and bound computed once, reusable across configurations."""

    trace: Trace  # the requests
    block_size: int  # kvcore block size the hashes are for
    requests: list[PreparedRequest]  # one per trace request
    bound: CacheBound  # the infinite-cache bound
    prepare_s: float  # wall seconds it took

    @staticmethod
    def build(trace: Trace, block_size: int | None = None) -> PreparedTrace:
        t0 = time.perf_counter()
        bs = block_size or trace.block_tokens
        hasher = TraceHasher(trace.block_tokens, bs)
        prepared = hasher.prepare_all(trace)
        bound = infinite_cache_bound(trace, prepared)
        return PreparedTrace(trace, bs, prepared, bound, time.perf_counter() - t0)

    def capacity_blocks(self, capacity_frac: float) -> int:
        """kvcore blocks per replica holding ``capacity_frac`` of the distinct trace blocks."""
        per_block = self.trace.block_tokens // self.block_size
        return max(1, math.ceil(capacity_frac * self.bound.distinct_blocks * per_block))


# Event kinds, ordered so that at equal times work finishes before new work starts.
_COPIES_DONE, _DECODE_DONE, _PREFILL_DONE, _DELIVER = 0, 1, 2, 3


class Simulator:
    """Replays one prepared trace under one `SimConfig`."""

    def __init__(
        self, prepared: PreparedTrace, config: SimConfig, *, wire: WireFn | None = None
    ) -> None:
        if config.block_size is not None and config.block_size != prepared.block_size:
            raise ValueError("the trace was prepared for another block size")
        self.prepared = prepared
        self.config = config
        self.wire = wire  # None: events reach the router as the pool made them
        self.clock = ManualClock(0.0)
        self.capacity = config.capacity_blocks or prepared.capacity_blocks(config.capacity_frac)
        self.host_slots = prepared.capacity_blocks(config.host_frac) if config.host_frac else 0
        self.disk_slots = prepared.capacity_blocks(config.disk_frac) if config.disk_frac else 0
        eviction: EvictionPolicy
        if config.eviction == "oracle":
            table = NextUseTable.build(prepared.trace, prepared.requests, config.time_scale)
            eviction = OracleEviction(table)
        else:
            eviction = make_eviction(config.eviction, **config.eviction_options)
        self.replicas = [
            SimReplica(
                f"replica-{i}",
                self.capacity,
                prepared.block_size,
                clock=self.clock,
                retained_share=config.retained_share,
                eviction=eviction,
                max_waiting=config.max_waiting,
                host_slots=self.host_slots,
                disk_slots=self.disk_slots,
                cost=config.cost,
            )
            for i in range(config.replicas)
        ]
        self.views = [r.view for r in self.replicas]
        if self.host_slots or self.disk_slots:
            # NOTE: what a gateway learns from each replica's heartbeat: a lower-tier
            # hit is priced by its copy time against recompute, from the same cost
            # model that times the copies and prefills here.
            cost = config.cost
            value = tier_value(
                cost.kv_bytes_per_token,
                cost.prefill_tokens_per_s(),
                cost.host_promote_bytes_per_s,
                cost.disk_promote_bytes_per_s,
            )
            for view in self.views:
                view.tier_value = value
        self._by_name = {r.view.name: r for r in self.replicas}
        options = dict(config.policy_options)
        if config.policy != "round_robin":
            options.setdefault("seed", config.seed)
        self.policy: RoutingPolicy = make_policy(config.policy, **options)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._usage = Usage()
        self._uncached = 0.0
        self._billed = 0.0
        self.events_applied = 0
        self.event_blocks = 0
        self.rejected = 0
        self.hit_tokens = 0
        self.ttfts: list[float] = []
        self.promote_waits: list[float] = []  # per request that promoted: seconds it waited
        self.waits: list[float] = []
        self.last_time = 0.0

    # ------------------------------------------------------------------ driver

    def run(self, progress: ProgressFn | None = None) -> SimResult:
        t0 = time.perf_counter()
        trace = self.prepared.trace
        scale = self.config.time_scale
        total = len(trace.requests)
        step = max(1, total // 200)
        heap = self._heap
        for i, (req, prep) in enumerate(zip(trace.requests, self.prepared.requests, strict=True)):
            now = req.arrival_s * scale
            while heap and heap[0][0] <= now:
                self._pop_event()
            self.clock.now = max(self.clock.now, now)
            self.last_time = max(self.last_time, now)
            self._arrive(Job(i, now, req, prep, self._breakpoints(req)))
            if progress is not None and (i % step == 0 or i == total - 1):
                progress(i + 1, total)
        while heap:
            self._pop_event()
        return self._result(time.perf_counter() - t0)

    def _push(self, at: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (at, kind, next(self._seq), payload))

    def _pop_event(self) -> None:
        at, kind, _, payload = heapq.heappop(self._heap)
        self.clock.now = max(self.clock.now, at)
        self.last_time = max(self.last_time, at)
        if kind == _COPIES_DONE:
            replica = payload
            if replica.settle(at):
                self._drain(replica)
        elif kind == _DECODE_DONE:
            replica, job = payload
            replica.finish(job)
            self._drain(replica)
            self._try_start(replica)
        elif kind == _PREFILL_DONE:
            self._prefill_done(payload)
        else:
            replica, events = payload
            self._apply(replica, events)

    # --------------------------------------------------------------- requests

    def _breakpoints(self, req: TraceRequest) -> tuple[TraceBreakpoint, ...]:
        mode = self.config.retention
        if req.input_length < self.config.min_cacheable_tokens or mode == "none":
            return ()
        if mode == "trace":
            return tuple(req.breakpoints)
        return (TraceBreakpoint(req.input_length, mode),)

    def _arrive(self, job: Job) -> None:
        prep = job.prep
        for replica in self.replicas:
            replica.refresh_load(job.arrival)
        try:
            decision = self.policy.choose(
                prep.block_hashes, self.views, self.prepared.block_size, num_tokens=job.input_length
            )
        except NoReplicaError:
            self.rejected += 1
            return
        replica = self._by_name[decision.replica]
        replica.enqueue(job)
        self._try_start(replica)

    def _try_start(self, replica: SimReplica) -> None:
        while replica.prefilling is None and replica.waiting:
            job = replica.waiting[0]
            read = self._lookup_entry(replica, job)
            started = replica.start(job, self.clock.now)
            self._drain(replica)
            if replica.pending:
                self._push(replica.pending[-1][0], _COPIES_DONE, replica)
            if started is None:
                if replica.idle:
                    # NOTE: nothing running can free blocks for it: the request is
                    # larger than what the pool can ever give it. Drop, count, go on.
                    replica.drop_head()
                    self.rejected += 1
                    continue
                return  # wait for a decode to finish and free blocks
            job.read_tokens = read
            now = self.clock.now
            self.waits.append(now - job.arrival)
            # NOTE: the prefill reads the promoted blocks, so it starts once they are
            # on the device: promotion time is part of TTFT (docs/sim.md, "Tiers").
            duration = job.promote_s + self.config.cost.prefill_s(
                job.input_length - started, started
            )
            if job.promoted:
                self.promote_waits.append(job.promote_s)
            replica.busy_s += duration
            replica.prefill_end = now + duration
            self._push(now + duration, _PREFILL_DONE, (replica, job))

    def _prefill_done(self, payload: tuple[SimReplica, Job]) -> None:
        replica, job = payload
        now = self.clock.now
        replica.commit(job)
        written = [self._write_entry(replica, job, bp) for bp in job.breakpoints]
        self._drain(replica)
        self.ttfts.append(now - job.arrival)
        self.hit_tokens += job.hit_tokens
        usage = usage_for(
            job.input_length, job.output_length, job.read_tokens, job.breakpoints, written
        )
        self._usage.add(usage)
        prices = self.config.prices
        self._billed += usage.cost(prices)
        self._uncached += usage.uncached_cost(prices)
        step = self.config.cost.decode_step_s(replica.context_tokens)
        self._push(now + job.output_length * step, _DECODE_DONE, (replica, job))
        self._try_start(replica)

    # -------------------------------------------------------------- retention

    def _entry_key(self, job: Job, position: int) -> EntryKey:
        bs = self.prepared.block_size
        return entry_key(job.prep.block_hashes[position // bs - 1], (), job.prep.keys)

    def _entry_position(self, tokens: int) -> int:
        # NOTE: a trace only knows sharing at its block granularity, so an entry sits
        # on the last trace-block boundary at or before its breakpoint (see docs/sim.md).
        bt = self.prepared.trace.block_tokens
        return (tokens // bt) * bt

    def _lookup_entry(self, replica: SimReplica, job: Job) -> int:
        """The cache read of a request: the longest live entry, breakpoints last first."""
        if not job.breakpoints:
            return 0
        bt = self.prepared.trace.block_tokens
        mgr = replica.manager
        for bp in reversed(job.breakpoints):
            top = self._entry_position(bp.tokens)
            positions = range(top, max(top - mgr.max_lookback * bt, 0), -bt)
            hit = mgr.lookup_entry([self._entry_key(job, p) for p in positions])
            if hit is not None:
                return hit.num_tokens
        return 0

    def _write_entry(self, replica: SimReplica, job: Job, bp: TraceBreakpoint) -> bool:
        if bp.tokens <= job.read_tokens:
            return True  # read, not written: usage_for skips it
        pos = self._entry_position(bp.tokens)
        if pos == 0:
            return False
        key = self._entry_key(job, pos)
        out = replica.manager.write_entry(key, pos, job.prep.block_hashes, TTL_SECONDS[bp.ttl])
        return out.written

    # ------------------------------------------------------------------ events

    def _drain(self, replica: SimReplica) -> None:
        events = replica.manager.take_events()
        if not events:
            return
        delay = self.config.event_delay_s
        if delay > 0:
            self._push(self.clock.now + delay, _DELIVER, (replica, events))
        else:
            self._apply(replica, events)

    def _apply(self, replica: SimReplica, events: Sequence[KVEvent]) -> None:
        if self.wire is not None:
            events = self.wire(replica, events)
        replica.view.index.apply_all(events)
        self.events_applied += len(events)
        for ev in events:
            if isinstance(ev, BlockStored | BlockRemoved):
                self.event_blocks += len(ev.block_hashes)

    # ------------------------------------------------------------------ result

    def _result(self, elapsed: float) -> SimResult:
        cfg = self.config
        prep = self.prepared
        bt = prep.trace.block_tokens
        bound = prep.bound
        hit_blocks = self.hit_tokens / bt
        hit_ratio = hit_blocks / bound.blocks if bound.blocks else 0.0
        ttfts = sorted(self.ttfts)
        waits = sorted(self.waits)
        busy = [r.busy_s for r in self.replicas]
        mean_busy = sum(busy) / len(busy)
        sd = math.sqrt(sum((b - mean_busy) ** 2 for b in busy) / len(busy))
        usage = self._usage
        out_cost = usage.output_cost(cfg.prices)
        stats = [r.stats() for r in self.replicas]
        return SimResult(
            trace=prep.trace.source,
            requests=len(prep.trace.requests),
            replicas=cfg.replicas,
            capacity_blocks=self.capacity,
            capacity_frac=self.capacity / (bound.distinct_blocks * (bt // prep.block_size) or 1),
            block_size=prep.block_size,
            policy=self.policy.name,
            eviction=cfg.eviction,
            retention=cfg.retention,
            time_scale=cfg.time_scale,
            event_delay_s=cfg.event_delay_s,
            seed=cfg.seed,
            hit_ratio=hit_ratio,
            token_hit_ratio=self.hit_tokens / bound.tokens if bound.tokens else 0.0,
            bound=bound.block_bound,
            token_bound=bound.token_bound,
            ratio_to_bound=hit_ratio / bound.block_bound if bound.block_bound else 0.0,
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p90_s=percentile(ttfts, 90),
            ttft_p99_s=percentile(ttfts, 99),
            ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else math.nan,
            queue_p50_s=percentile(waits, 50),
            queue_p90_s=percentile(waits, 90),
            queue_p99_s=percentile(waits, 99),
            queue_mean_s=sum(waits) / len(waits) if waits else math.nan,
            load_imbalance=max(busy) / mean_busy if mean_busy else 1.0,
            load_cv=sd / mean_busy if mean_busy else 0.0,
            billed_cost=self._billed,
            uncached_cost=self._uncached,
            cost_saving=1.0 - self._billed / self._uncached if self._uncached else 0.0,
            input_cost_saving=1.0 - (self._billed - out_cost) / (self._uncached - out_cost)
            if self._uncached > out_cost
            else 0.0,
            input_tokens=usage.input_tokens,
            cache_read_input_tokens=usage.cache_read_input_tokens,
            cache_creation_input_tokens=usage.ephemeral_5m_input_tokens
            + usage.ephemeral_1h_input_tokens,
            rejected=self.rejected,
            evictions=sum(s.evictions for s in stats),
            retain_refusals=sum(r.pool.num_retain_refusals for r in self.replicas),
            events=self.events_applied,
            event_blocks=self.event_blocks,
            sim_time_s=self.last_time,
            elapsed_s=elapsed,
            prepare_s=prep.prepare_s,
            per_replica=tuple(stats),
            ttft_s=tuple(ttfts),
            **self._tier_figures(),
        )

    def _tier_figures(self) -> dict[str, Any]:
        """The per-tier fields of `SimResult`."""
        prep = self.prepared
        blocks = prep.bound.blocks * (prep.trace.block_tokens // prep.block_size)
        by_tier: dict[str, float] = {}
        for replica in self.replicas:
            for tier, n in replica.hit_blocks.items():
                by_tier[str(tier)] = by_tier.get(str(tier), 0.0) + n
        tiers: dict[str, dict[str, int]] = {}
        for replica in self.replicas:
            for st in replica.pool.tier_stats():
                row = tiers.setdefault(str(st.tier), {"slots": st.slots})
                for key in ("hits", "promotions", "demotions", "evictions", "dropped"):
                    row[key] = row.get(key, 0) + getattr(st, key)
                row["failed_copies"] = row.get("failed_copies", 0) + st.failed_copies
        for replica in self.replicas:
            links = replica.links
            for name, row in tiers.items():
                row["promoted_bytes"] = row.get("promoted_bytes", 0) + links.promoted_bytes.get(
                    name, 0
                )
                row["demoted_bytes"] = row.get("demoted_bytes", 0) + links.demoted_bytes.get(
                    name, 0
                )
        span = self.last_time or 1.0
        busy = {
            link: sum(r.links.busy_s[link] for r in self.replicas) / len(self.replicas) / span
            for link in LINKS
        }
        waits = sorted(self.promote_waits)
        cfg = self.config
        return {
            "host_frac": cfg.host_frac,
            "disk_frac": cfg.disk_frac,
            "host_slots": self.host_slots,
            "disk_slots": self.disk_slots,
            "hit_ratio_by_tier": {t: n / blocks if blocks else 0.0 for t, n in by_tier.items()},
            "tiers": tiers,
            "promoted_requests": len(waits),
            "promote_p50_s": percentile(waits, 50),
            "promote_p90_s": percentile(waits, 90),
            "promote_max_s": waits[-1] if waits else math.nan,
            "link_busy": busy,
        }


def run_simulation(
    trace: Trace | PreparedTrace,
    config: SimConfig,
    progress: ProgressFn | None = None,
) -> SimResult:
    """Prepare (if needed) and replay one configuration."""
    prepared = (
        trace if isinstance(trace, PreparedTrace) else PreparedTrace.build(trace, config.block_size)
    )
    return Simulator(prepared, config).run(progress)
