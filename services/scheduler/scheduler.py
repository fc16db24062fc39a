"""The replica scheduler: admission, continuous batching, commit/abort, stats.

Threading model. Everything that touches kvcore runs on the asyncio event-loop
thread; only the engine's forward pass runs in a worker thread
(one dedicated engine thread). While a step is in flight the loop does not change any
allocation the step reads: cancellations are flags that the loop acts on at the next
step boundary. That keeps kvcore lock-free and the block tables stable under the GPU.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from cachepoint.engine import (
    DecodeRequest,
    Engine,
    PrefillRequest,
    SamplingParams,
    StopChecker,
)
from cachepoint.engine.sampling import make_generator, sample_each
from cachepoint.kvcore import (
    EVICTION_POLICIES,
    Allocation,
    BlockCopy,
    BlockHash,
    BlockPool,
    CacheStats,
    KVCacheManager,
    KVEvent,
    PoolExhaustedError,
    Tier,
    TierStore,
    hash_blocks,
    monotonic_clock,
)

from . import admission
from .core import DeathHook, EventSink, FinishHook
from .errors import (
    CancelledRequestError,
    DrainingError,
    EngineFailedError,
    InvalidRequestError,
    OverloadedError,
    QueueFullError,
    ReplicaFailedError,
    RequestFailedError,
)
from .rates import Rates
from .schemas import CacheReport, GenerateRequest, GenerateResponse, Timings
from .sequence import PrefillDone, SeqStatus, SequenceState
from .settings import ReplicaSettings
from .stopping import TurnEnd, append_token

log = logging.getLogger(__name__)

Sampled = list[int | Exception] | Exception
"""A step's sampled tokens, one per sampled row (or that row's error), or the error
that failed the whole step's sampling."""


class CountingSink:
    """Default sink: counts events and drops them (no event plane configured)."""

    def __init__(self) -> None:
        self.published = 0  # events seen, ever

    def publish(self, epoch: int, events: list[KVEvent]) -> None:
        self.published += len(events)


@dataclass(slots=True)
class StepBatch:
    """What one engine step runs."""

    prefills: list[tuple[SequenceState, PrefillRequest]] = field(default_factory=list)
    decodes: list[tuple[SequenceState, DecodeRequest]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def seqs(self) -> list[SequenceState]:
        return [s for s, _ in self.prefills] + [s for s, _ in self.decodes]


def engine_executor(name: str) -> ThreadPoolExecutor:
    """The one thread a replica's engine is built on and stepped on.

    NOTE: one and the same thread for both: torch keeps an OpenMP team per thread that
    runs a parallel op, and once a process's OpenMP threads outnumber its cores libgomp
    stops spinning between parallel regions and sleeps instead, so an engine built on
    one thread and stepped on another pays a futex wake per op (bench/RESULTS.md, "One
    torch thread per replica").
    """
    return ThreadPoolExecutor(1, thread_name_prefix=f"engine-{name}")


class Scheduler:
    """Owns the replica's kvcore pool and drives its engine."""

    # NOTE: a run of decode steps ends once it took this long, whatever decode_steps
    # says: it exists to amortize a 0.1-0.15 ms hop between threads, which is worth it
    # for steps of a millisecond, not for SmolLM2's 50 ms ones, where a longer run
    # would only make a new request wait longer for its prefill.
    multi_step_budget_s = 0.005

    def __init__(
        self,
        engine: Engine,
        settings: ReplicaSettings,
        *,
        clock: Callable[[], float] = monotonic_clock,
        sink: EventSink | None = None,
        on_finish: FinishHook | None = None,
        num_blocks: int | None = None,
        engine_thread: ThreadPoolExecutor | None = None,
    ) -> None:
        """``num_blocks`` caps the pool at that many of the engine's blocks (default:
        all): benchmarks on a GPU, whose engine sizes its pool by free memory, use it to
        run on a pool of a chosen size. It must hold one max_model_len sequence.

        ``engine_thread``: the one-thread executor that built ``engine`` (see
        :func:`engine_executor`); the scheduler runs every step on it, and whoever
        made it shuts it down. Default: a new one of the scheduler's own."""
        self.engine = engine
        self.settings = settings
        self.name = settings.name
        self.model = settings.model_name
        self.block_size = engine.block_size
        self.max_model_len = engine.max_model_len
        # The random model's turn length (0 = none); a checkpoint ends its own turns.
        self._turn_end = TurnEnd(
            engine.eos_ids,
            engine.eos_id,
            settings.random_turn_tokens if engine.model_dir is None else 0,
        )
        blocks = engine.num_blocks if num_blocks is None else num_blocks
        least = -(-engine.max_model_len // engine.block_size)
        if not least <= blocks <= engine.num_blocks:
            raise ValueError(
                f"num_blocks {blocks} must be within {least}..{engine.num_blocks}: at least "
                f"one max_model_len ({engine.max_model_len}) sequence, at most the engine's"
            )
        self.pool = BlockPool(
            blocks,
            engine.block_size,
            retained_share=settings.retained_share,
            owner_share=settings.org_retained_share,
            clock=clock,
            eviction=EVICTION_POLICIES[settings.eviction](),
            lower=self._lower_tiers(engine, settings, clock),
        )
        self.rates = Rates()  # measured prefill and copy speeds, for the router
        self.copy_s = 0.0  # seconds the engine spent on tier copies, ever
        self.copied_blocks = 0  # blocks it copied between tiers, ever
        self.manager = KVCacheManager(self.pool)
        # NOTE: a fresh epoch per process start, monotonic across restarts, and a
        # `cleared` event to open it: consumers drop whatever they knew before.
        self.epoch = time.time_ns()
        self.manager.clear()
        self.sink: EventSink = sink or CountingSink()
        self.on_finish = on_finish
        # NOTE: kept sorted by `SequenceState.rank` (priority, then arrival): admission
        # walks it in order, and a preempted sequence goes back to its rank's place.
        self.waiting: list[SequenceState] = []
        self._arrivals = 0  # submissions so far: each sequence's arrival number
        self.running: list[SequenceState] = []
        self.steps = 0  # engine steps run, ever
        self.preemptions = 0  # running sequences requeued to recompute, ever
        self._ids: set[str] = set()
        self._wake = asyncio.Event()
        self._own_thread = engine_thread is None
        self._engine_thread = engine_thread or engine_executor(self.name)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # NOTE: set by draining.Drainer and never cleared: a replica that drains is on
        # its way out; its heartbeats say so until the process exits.
        self.draining = False
        self.failure: BaseException | None = None  # what killed the loop, if it died
        self.on_death: DeathHook | None = None  # called once, after the loop died
        # Test hook: called with each non-empty batch outside every per-request guard, so
        # raising in it kills the loop (see watchdog.py).
        self.fault_hook: Callable[[StepBatch], None] | None = None
        self.tracer: trace.Tracer = trace.NoOpTracer()  # set by the app when tracing is on

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def unavailable(self) -> str | None:
        return None  # the engine lives in this process: it is up while the loop is

    @property
    def kv_bytes_per_token(self) -> int:
        return self.engine.kv_block_bytes // self.block_size

    @property
    def lapsed_entries(self) -> int:
        return 0  # kvcore retains an entry's blocks until its TTL: none ever lapse

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def device(self) -> str:
        return str(self.engine.device)

    def snapshot(self) -> dict[str, list[BlockHash]]:
        out: dict[str, list[BlockHash]] = {"device": list(self.pool.cached)}
        for store in self.pool.lower or ():
            out[str(store.tier)] = store.visible_hashes()
        return out

    async def stop(self) -> None:
        """Finish every request with an error, return every block, stop the loop."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        # The loop is done, so no step is in flight; a step of a dead loop may still be.
        if self._own_thread:
            self._engine_thread.shutdown(wait=False)
        for seq in [*self.waiting, *self.running]:
            self._finish(seq, error=OverloadedError("replica is shutting down"))
        self.flush_events()

    # ---------------------------------------------------------------- intake

    def submit(self, req: GenerateRequest) -> SequenceState:
        """Validate and queue a request. Raises InvalidRequestError or QueueFullError."""
        if self._stopping:
            why = " (scheduler loop stopped)" if self.failure is not None else ""
            raise OverloadedError(f"replica {self.name} is shutting down{why}")
        if self.draining:
            raise DrainingError(
                f"replica {self.name} is draining: it takes no new requests; retry on "
                "another replica"
            )
        n = len(req.token_ids)
        vocab = self.engine.vocab_size
        bad = next((i for i, t in enumerate(req.token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token_ids.{bad}: {req.token_ids[bad]} is not a token id (0..{vocab - 1})"
            )
        bad = next((i for i, t in enumerate(req.stop_token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"stop_token_ids.{bad}: {req.stop_token_ids[bad]} is not a token id "
                f"(0..{vocab - 1})"
            )
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {n} tokens leaves no room to generate: max_model_len is "
                f"{self.max_model_len}"
            )
        # NOTE: the engine sizes its pool to hold at least one max_model_len sequence,
        # so anything within max_model_len fits an empty pool.
        max_tokens = min(req.max_tokens, self.max_model_len - n)
        if len(self.waiting) >= self.settings.max_waiting:
            raise QueueFullError(
                f"{len(self.waiting)} requests already waiting on replica {self.name}"
            )
        request_id = req.request_id or f"req_{uuid.uuid4().hex}"
        if request_id in self._ids:
            raise InvalidRequestError(f"request_id {request_id} is already running here")
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                stop=tuple(req.stop_sequences),
                stop_token_ids=tuple(req.stop_token_ids),
                seed=req.seed,
                ignore_eos=req.ignore_eos,
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        spans = [(s.start_block, list(s.extra_keys)) for s in req.key_spans]
        schedule = admission.key_schedule(spans)
        owner = admission.retention_owner(req.retention_owner, req.owner_retained_share)
        bps = [
            admission.Breakpoint(
                position=bp.position,
                ttl_label=bp.ttl,
                extra_keys=tuple(bp.extra_keys)
                if bp.extra_keys is not None
                else admission.keys_at_block(schedule, (bp.position - 1) // self.block_size),
                boundaries=tuple(bp.boundaries),
                owner=owner,
            )
            for bp in req.breakpoints
        ]
        loop = asyncio.get_running_loop()
        seq = SequenceState(
            request_id=request_id,
            prompt=list(req.token_ids),
            key_spans=spans,
            breakpoints=bps,
            params=params,
            stream=asyncio.Queue(),
            done=loop.create_future(),
            stopper=StopChecker(self.engine.tokenizer, params.stop),
            generator=make_generator(params, self.engine.device),
            otel_ctx=otel_context.get_current(),
            priority=req.priority,
            arrival=self._arrivals,
        )
        self._arrivals += 1
        self._ids.add(request_id)
        self._enqueue(seq)
        self._wake.set()
        return seq

    def cancel(self, seq: SequenceState) -> None:
        """The client went away. Acted on at the next step boundary, never mid-step."""
        if seq.status is not SeqStatus.FINISHED:
            seq.cancelled = True
            self._wake.set()

    # ------------------------------------------------------------------ loop

    async def _loop(self) -> None:
        try:
            await self._run()
        except Exception as exc:
            # NOTE: not re-raised: the task ends either way (``alive`` turns False), and
            # an exception left in it would resurface in stop() during shutdown.
            self._die(exc)

    def _die(self, exc: Exception) -> None:
        """The loop is gone: fail every request here at once, and say so."""
        self.failure = exc
        self._stopping = True
        pending = [*self.waiting, *self.running]
        log.critical(
            "scheduler loop died; failing %d requests",
            len(pending),
            exc_info=exc,
            extra={"fields": {"event": "loop_died", "replica": self.name, "epoch": self.epoch}},
        )
        err = ReplicaFailedError(
            f"replica {self.name} failed: scheduler loop stopped ({type(exc).__name__}: {exc})"
        )
        for seq in pending:
            try:
                self._finish(seq, error=err)
            except Exception:
                log.exception("could not fail request %s", seq.request_id)
        with contextlib.suppress(Exception):
            self.flush_events()
        if self.on_death is not None:
            try:
                self.on_death(exc)
            except Exception:
                log.exception("on_death hook failed")

    @staticmethod
    def _lower_tiers(
        engine: Engine, settings: ReplicaSettings, clock: Callable[[], float]
    ) -> TierStore | None:
        """The host tier (and the disk tier behind it) the engine allocated, if any."""
        host, disk = engine.host_kv_slots, engine.disk_kv_slots
        if not host:
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

        return store(Tier.HOST, host, store(Tier.DISK, disk) if disk else None)

    async def _copy(self, copies: list[BlockCopy]) -> bool:
        """Run queued tier copies on the engine thread, then publish or drop what they
        demoted. False when they failed: whatever they were promoting must not run.

        NOTE: a step's copies run as their own engine call, before its forward, so the
        promote span measures the transfer alone; only steps that have copies pay the
        extra hop."""
        t0 = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._engine_thread, self.engine.copy_blocks, copies
            )
        except Exception as exc:
            log.warning("tier copies failed: %s", exc)
            self.manager.finish_copies(copies, ok=False)
            return False
        dt = time.perf_counter() - t0
        self.copy_s += dt
        self.copied_blocks += len(copies)
        disk = any(Tier.DISK in (c.src_tier, c.dst_tier) for c in copies)
        self.rates.copies(len(copies) * self.engine.kv_block_bytes, dt, disk=disk)
        self.manager.finish_copies(copies, ok=True)
        return True

    async def _run_copies(self) -> bool:
        """The copies queued since the last step; on failure every sequence whose
        promotion was among them fails (its blocks were never filled)."""
        copies = self.manager.take_copies()
        if not copies:
            return True
        # NOTE: every sequence admitted since the last step, scheduled now or not: its
        # promotions are among these copies, which run now whatever the batch holds.
        promoting = [s for s in self.running if s.promoting]
        ok = await self._copy(copies)
        for seq in promoting:
            seq.promoting = False
            span, seq.promote_span = seq.promote_span, None
            if span is not None:
                if not ok:
                    span.set_status(Status(StatusCode.ERROR, "tier copy failed"))
                span.end()
            if not ok:
                self._finish(seq, error=EngineFailedError("KV tier copy failed"))
        return ok

    async def _run(self) -> None:
        while not self._stopping:
            self._reap_cancelled()
            # NOTE: growth first, so running sequences get the blocks before newcomers;
            # and no admission in a round that preempted, or the victim (back in the
            # queue) would take back the blocks it just gave up.
            if not self._grow():
                self._admit()
            batch = self._schedule()
            if self.fault_hook is not None and not batch.empty:
                self.fault_hook(batch)
            # NOTE: before the copies: the blocks a run of steps needs may evict cached
            # ones, whose demotions must be copied before the run overwrites them.
            k = self._decode_steps(batch)
            if not await self._run_copies():
                self.flush_events()
                continue
            if batch.empty:
                self.flush_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.perf_counter()
            failed: Exception | None = None  # a later step of a run that failed
            try:
                if k > 1:
                    steps, failed = await asyncio.get_running_loop().run_in_executor(
                        self._engine_thread, self._forward_decodes, batch, k
                    )
                else:
                    tokens = await asyncio.get_running_loop().run_in_executor(
                        self._engine_thread, self._forward, batch, self._to_sample(batch)
                    )
                    steps = [(batch, tokens)]
            except Exception as exc:  # the forward failed: every sequence in it fails
                log.warning("engine step failed: %s", exc)
                for seq in batch.seqs:
                    self._finish(seq, error=EngineFailedError(f"forward pass failed: {exc}"))
            else:
                self.steps += len(steps)
                computed = sum(len(r.token_ids) - r.num_cached_tokens for _, r in batch.prefills)
                self.rates.prefill(computed, time.perf_counter() - t0)
                for step_batch, tokens in steps:
                    try:
                        self._advance(step_batch, tokens)
                    except Exception as exc:  # not one sequence's: the step's output itself
                        for seq in step_batch.seqs:
                            self._fail(seq, exc)
                if failed is not None:  # the steps before it stand, as they would have
                    log.warning("engine step failed: %s", failed)
                    for seq in batch.seqs:
                        self._finish(seq, error=EngineFailedError(f"forward pass failed: {failed}"))
            self.flush_events()

    def _fail(self, seq: SequenceState, exc: Exception) -> None:
        """Something raised while handling ``seq``: it fails alone, the loop goes on."""
        if seq.status is SeqStatus.FINISHED:
            return
        log.error("request %s failed inside the replica", seq.request_id, exc_info=exc)
        self._finish(
            seq,
            error=RequestFailedError(
                f"request failed inside replica {self.name}: {type(exc).__name__}: {exc}"
            ),
        )

    def _reap_cancelled(self) -> None:
        for seq in [s for s in (*self.waiting, *self.running) if s.cancelled]:
            self._finish(seq, error=CancelledRequestError("client disconnected"))

    def _enqueue(self, seq: SequenceState) -> None:
        """Into the waiting queue at its rank: by priority, FIFO within one."""
        bisect.insort(self.waiting, seq, key=lambda q: q.rank)

    def _admit(self) -> None:
        """Admission in queue order (priority, then arrival) while sequences and blocks
        allow, without head-of-line blocking.

        NOTE: admission reserves the prompt plus `decode_reserve_blocks` (never less
        than the first decode's slot), not prompt + max_tokens: a `max_tokens: 32000`
        must not hold 32,000 tokens of KV it may never use. Running sequences grow one
        block at a time in `_grow`, which preempts the lowest-priority one when full.

        NOTE: a request whose blocks do not fit is passed over, and later ones that fit
        still run (a small request must not wait behind a large one). Each admission
        past it counts; at `max_admission_bypass` nothing more goes past it until it
        fits, so a large request is delayed a bounded amount, never starved.
        """
        limit = self.settings.max_admission_bypass
        blocked: list[SequenceState] = []  # passed over in this round, in queue order
        for seq in list(self.waiting):
            if len(self.running) >= self.settings.max_num_seqs:
                return
            if seq.status is SeqStatus.FINISHED:
                continue  # failed by an earlier admission in this round
            if blocked and self.running and not len(self.pool.free_queue):
                return  # nothing free: no later request can fit either
            try:
                if not self._admit_one(seq):
                    if seq.bypassed >= limit:
                        return
                    blocked.append(seq)
                    continue
            except Exception as exc:  # a plan or trace that raised: this request only
                self._fail(seq, exc)
                continue
            for b in blocked:
                b.bypassed += 1
            if any(b.bypassed >= limit for b in blocked):
                return

    def _admit_one(self, seq: SequenceState) -> bool:
        """Admit ``seq`` from the waiting queue (or fail it); False when it must wait
        for blocks."""
        resumed = seq.cache is not None  # committed once, preempted since: recompute
        n = seq.prefill_len
        # Token slots it can ever use: the last sampled token is never fed back.
        cap = seq.prompt_len + seq.params.max_tokens - 1
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
            cp = admission.plan(self.manager, seq.prompt, schedule, seq.breakpoints)
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
                # turned away; if the pool stays full it ends at `max_tokens` (_grow).
                alloc = self._allocate(hashes, n, least)
            except PoolExhaustedError:
                # Nothing will free blocks: what is held is retained by TTL.
                self._finish(seq, error=OverloadedError(f"KV pool is full: {exc}"))
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
        if resumed:
            seq.prefill_span = self.tracer.start_span("recompute", context=seq.otel_ctx)
        else:
            seq.t_admit = time.perf_counter()
            self._trace_admission(seq)
        if alloc.num_promoted_blocks:
            seq.promoting = True
            self._trace_promotion(seq, alloc)
        return True

    def _trace_promotion(self, seq: SequenceState, alloc: Allocation) -> None:
        """A `promote` span inside the prefill: from admission until its copies ran."""
        if seq.prefill_span is None:
            return
        ctx = trace.set_span_in_context(seq.prefill_span, seq.otel_ctx)
        span = self.tracer.start_span("promote", context=ctx)
        block_bytes = self.block_bytes
        for tier, n in alloc.promoted_by_tier.items():
            span.set_attribute(f"cachepoint.promote.{tier}_blocks", n)
        span.set_attribute("cachepoint.promote.blocks", alloc.num_promoted_blocks)
        span.set_attribute("cachepoint.promote.bytes", alloc.num_promoted_blocks * block_bytes)
        seq.promote_span = span

    def _may_fit(self, seq: SequenceState, slots: int, resumed: bool) -> bool:
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

    def _grow(self) -> bool:
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

    def _grow_one(self, seq: SequenceState) -> bool:
        assert seq.alloc is not None
        k = len(seq.output)
        need = seq.prompt_len + k  # slots once the next decode wrote its token
        # One slot ahead unless the token this step samples is the last anyway.
        want = min(need + 1, seq.prompt_len + seq.params.max_tokens - 1)
        preempted = False
        while True:
            try:
                seq.alloc.grow(max(want, need))
                return preempted
            except PoolExhaustedError:
                if len(self.running) == 1:
                    break
            victim = max(self.running, key=lambda q: q.rank)
            self._preempt(victim)
            preempted = True
            if victim is seq:
                return True
        # Alone and the pool is full (what else is held is retained by TTL): the
        # context is full, so it ends like a length stop, not with an error.
        try:
            seq.alloc.grow(need)
        except PoolExhaustedError:
            seq.stop_reason = "max_tokens"  # NOTE: unreachable while admission keeps `least`
            self._finish(seq)
        else:
            seq.context_full = True
        return preempted

    def _publish_progress(self, seq: SequenceState) -> None:
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

    def _preempt(self, seq: SequenceState) -> None:
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
        self.engine.forget(seq.arrival)  # its next admission gets other blocks
        if committed:
            seq.recompute = len(seq.output)
        else:
            # NOTE: before its first commit nothing was reported or streamed: it starts
            # over as a fresh admission (a new plan, a new cache report).
            seq.plan = None
            self._end_prefill_span(seq, None, preempted=True)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.running.remove(seq)
        self._enqueue(seq)
        if seq.decode_span is not None:
            seq.decode_span.add_event("preempted", {"cachepoint.output_tokens": len(seq.output)})
        log.info(
            "preempted %s after %d tokens",
            seq.request_id,
            len(seq.output),
            extra={"fields": {"event": "preempted", "replica": self.name}},
        )

    def _schedule(self) -> StepBatch:
        """Decodes first (one token each), then prefill chunks in the remaining budget,
        so a long prompt never stalls the sequences that are already generating."""
        batch = StepBatch()
        budget = self.settings.max_num_batched_tokens
        for seq in self.running:
            if seq.status is SeqStatus.DECODING:
                assert seq.alloc is not None
                pos = seq.prompt_len + len(seq.output) - 1
                req = DecodeRequest(seq.output[-1], pos, seq.alloc.block_ids, seq_id=seq.arrival)
                batch.decodes.append((seq, req))
        budget -= len(batch.decodes)
        for seq in self.running:
            if budget <= 0:
                break
            if seq.status is SeqStatus.PREFILLING:
                assert seq.alloc is not None
                chunk = min(seq.remaining_prefill, budget)
                end = seq.num_computed + chunk
                req = PrefillRequest(
                    seq.prefill_tokens(end), seq.alloc.block_ids, seq.num_computed, seq.arrival
                )
                batch.prefills.append((seq, req))
                budget -= chunk
        return batch

    def _trace_admission(self, seq: SequenceState) -> None:
        assert seq.plan is not None
        assert seq.alloc is not None
        admit = self.tracer.start_span("admit", context=seq.otel_ctx, start_time=seq.t_submit_ns)
        admit.set_attributes(
            {
                "cachepoint.admit.hash_blocks": len(seq.plan.block_hashes),
                "cachepoint.admit.engine_hit_tokens": seq.alloc.num_cached_tokens,
                "cachepoint.admit.entry_hit_tokens": seq.plan.entry_hit_tokens,
                "cachepoint.admit.queue_wait_s": seq.t_admit - seq.t_submit,
                "cachepoint.replica": self.name,
                "cachepoint.epoch": self.epoch,
            }
        )
        admit.end()
        seq.prefill_span = self.tracer.start_span("prefill", context=seq.otel_ctx)

    @staticmethod
    def _to_sample(batch: StepBatch) -> list[int]:
        """Which prefills finish their prompt this step (indices into ``batch.prefills``):
        they and every decode get a token. Decided on the loop's thread, before the
        step, so the engine thread reads nothing the loop may change meanwhile."""
        return [
            i
            for i, (seq, req) in enumerate(batch.prefills)
            if len(req.token_ids) == seq.prefill_len
        ]

    def _forward(self, batch: StepBatch, finishing: list[int]) -> Sampled:
        """One step on the engine thread: the forward, then one token for each row that
        needs one (the finishing prefills, then the decodes), sampled where the logits
        are, with one transfer of the ids to the host.

        NOTE: sampling here, not on the loop's thread, for the reason in
        ``engine_executor``: a second OpenMP team makes libgomp throttle. Sampling's own
        failure is returned, not raised: the forward's blocks are fine, only the sampled
        rows fail.
        """
        out = self.engine.step([r for _, r in batch.prefills], [r for _, r in batch.decodes])
        rows = [batch.prefills[i][0] for i in finishing] + [seq for seq, _ in batch.decodes]
        if not rows:
            return []
        try:
            logits = out.decode_logits
            if finishing:
                index = torch.tensor(finishing, device=out.prefill_logits.device)
                logits = torch.cat([out.prefill_logits.index_select(0, index), logits])
            tokens = sample_each(logits, [s.params for s in rows], [s.generator for s in rows])
        except Exception as exc:
            return exc
        return tokens

    def _decode_steps(self, batch: StepBatch) -> int:
        """How many decode steps to run back to back for ``batch`` (1: just this one).

        NOTE: vLLM's multi-step scheduling: only a decode-only batch with nothing
        waiting, no cancellation pending and no fault hook, and only as many steps as
        every sequence may still take (its ``max_tokens``) with the slots for them
        already in its blocks. A pool that cannot give them without preempting
        anyone means one step, as before.
        """
        k = self.settings.decode_steps
        if k <= 1 or not batch.decodes or batch.prefills or self.waiting or self.fault_hook:
            return 1
        for seq, _ in batch.decodes:
            if seq.cancelled or seq.context_full:
                return 1
            k = min(k, seq.params.max_tokens - len(seq.output))
        if k <= 1:
            return 1
        for seq, _ in batch.decodes:
            assert seq.alloc is not None
            need = seq.prompt_len + len(seq.output) + k - 1  # slots the k steps write
            # One slot ahead as `_grow` keeps, unless the last of them samples the last.
            want = min(need + 1, seq.prompt_len + seq.params.max_tokens - 1)
            try:
                seq.alloc.grow(max(need, want))
            except PoolExhaustedError:
                return 1
        return k

    def _forward_decodes(
        self, batch: StepBatch, k: int
    ) -> tuple[list[tuple[StepBatch, Sampled]], Exception | None]:
        """Up to ``k`` decode steps on the engine thread, each fed the tokens the last
        one sampled; stops early at a failed row or past ``multi_step_budget_s``.
        Returns each step's batch and tokens, and what failed the forward of a step
        after the first (the first one's raises)."""
        steps: list[tuple[StepBatch, Sampled]] = []
        deadline = time.perf_counter() + self.multi_step_budget_s
        for _ in range(k):
            try:
                tokens = self._forward(batch, [])
            except Exception as exc:
                if not steps:
                    raise
                return steps, exc
            steps.append((batch, tokens))
            if isinstance(tokens, Exception) or len(steps) == k:
                break
            if time.perf_counter() >= deadline:
                break
            if any(isinstance(t, Exception) for t in tokens):
                break
            batch = StepBatch(
                decodes=[
                    (seq, DecodeRequest(t, r.position + 1, r.block_table, seq_id=r.seq_id))
                    for (seq, r), t in zip(batch.decodes, tokens, strict=True)
                ]
            )
        return steps, None

    def _advance(self, batch: StepBatch, tokens: Sampled) -> None:
        """Commit finished prefills, append the sampled tokens. Whatever raises for one
        sequence (its commit, its sampling parameters, decoding its text) fails that one
        alone; a sampling failure of the whole batch fails its sampled rows."""
        sampled: list[SequenceState] = []
        size = len(batch.prefills) + len(batch.decodes)
        for seq, req in batch.prefills:
            seq.max_batch = max(seq.max_batch, size)
            seq.num_computed = len(req.token_ids)
            if seq.num_computed == seq.prefill_len:
                sampled.append(seq)
                try:
                    self._commit_prefill(seq)
                except Exception as exc:
                    self._fail(seq, exc)
                    continue
        sampled += [seq for seq, _ in batch.decodes]
        if isinstance(tokens, Exception):
            tokens = [tokens] * len(sampled)
        for seq, token in zip(sampled, tokens, strict=True):
            if seq.status is SeqStatus.FINISHED:
                continue  # its commit failed above
            try:
                if isinstance(token, Exception):
                    raise token
                self._append_token(seq, token)
            except Exception as exc:
                self._fail(seq, exc)

    def _commit_prefill(self, seq: SequenceState) -> None:
        """Write-then-publish, then the managed entries at the breakpoints."""
        assert seq.alloc is not None
        assert seq.plan is not None
        self._end_prefill_span(seq, None)
        promoted = seq.alloc.num_promoted_blocks
        if seq.cache is not None:
            # NOTE: a recompute after a preemption: the report and `prefill_done` went
            # out at the first commit and stand (billed once); entries were written then.
            seq.alloc.commit()
            seq.status = SeqStatus.DECODING
            return
        with self.tracer.start_as_current_span("publish", context=seq.otel_ctx) as span:
            stored = seq.alloc.commit()
            admission.write_entries(self.manager, seq.plan)
            # Publish now, inside this span, so the NATS message carries its context.
            events = self.flush_events()
            span.set_attributes(
                {
                    "cachepoint.publish.blocks_stored": stored,
                    "cachepoint.publish.events": events,
                    "cachepoint.publish.entries_written": len(seq.plan.written),
                }
            )
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
        seq.t_first = time.perf_counter()
        seq.decode_span = self.tracer.start_span("decode", context=seq.otel_ctx)
        seq.stream.put_nowait(PrefillDone(seq.cache))

    def _end_prefill_span(
        self, seq: SequenceState, error: Exception | None, *, preempted: bool = False
    ) -> None:
        span, seq.prefill_span = seq.prefill_span, None
        if span is None:
            return
        hit = seq.alloc.num_cached_tokens if seq.alloc is not None else 0
        span.set_attributes(
            {
                "cachepoint.prefill.computed_tokens": seq.num_computed - hit,
                "cachepoint.prefill.cached_tokens": hit,
                "cachepoint.prefill.device": str(self.engine.device),
                "cachepoint.prefill.batch_size": seq.max_batch,
                "cachepoint.prefill.tensor_parallel_size": self.settings.tensor_parallel_size,
            }
        )
        if preempted:
            span.set_attribute("cachepoint.preempted", True)
        if error is not None:
            span.set_attribute("cachepoint.aborted", True)
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end()

    def _append_token(self, seq: SequenceState, token: int) -> None:
        if append_token(seq, token, self._turn_end):
            self._finish(seq)

    def _finish(self, seq: SequenceState, error: Exception | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        try:
            self._close_spans(seq, error)
        except Exception:  # tracing must never keep a request from ending
            log.exception("closing the spans of %s failed", seq.request_id)
        if seq.alloc is not None:
            seq.alloc.close()  # abort if the prefill never committed, else free
            self.engine.forget(seq.arrival)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.t_end = time.perf_counter()
        self._ids.discard(seq.request_id)
        seq.stream.put_nowait(None)
        if not seq.done.done():
            if error is None:
                seq.done.set_result(None)
            else:
                seq.done.set_exception(error)
                seq.done.exception()  # mark retrieved: a vanished client may never await it
        if self.on_finish is not None:
            try:
                self.on_finish(seq)
            except Exception:  # metrics and logs must never fail a request or the loop
                log.exception("on_finish hook failed for %s", seq.request_id)

    def _close_spans(self, seq: SequenceState, error: Exception | None) -> None:
        self._end_prefill_span(seq, error or CancelledRequestError("finished before commit"))
        if seq.decode_span is not None:
            seq.decode_span.set_attribute("gen_ai.usage.output_tokens", len(seq.output))
            if error is not None:
                seq.decode_span.record_exception(error)
                seq.decode_span.set_status(Status(StatusCode.ERROR, str(error)))
            seq.decode_span.end()
            seq.decode_span = None

    def flush_events(self) -> int:
        """Hand every pending kv event to the sink now; returns how many there were.
        Snapshots call this first; so does a commit, inside its `publish` span."""
        events = self.manager.take_events()
        if events:
            self.sink.publish(self.epoch, events)
        return len(events)

    # --------------------------------------------------------------- results

    def result(self, seq: SequenceState) -> GenerateResponse:
        assert seq.cache is not None
        assert seq.stop_reason is not None
        t_first = seq.t_first or seq.t_end
        return GenerateResponse(
            request_id=seq.request_id,
            replica=self.name,
            epoch=self.epoch,
            model=self.model,
            output_token_ids=seq.output,
            text=seq.stopper.text,
            stop_reason=seq.stop_reason,  # type: ignore[arg-type]
            stop_sequence=seq.stopper.stopped_on,
            output_tokens=len(seq.output),
            cache=seq.cache,
            timings=Timings(
                queue_s=seq.t_admit - seq.t_submit,
                prefill_s=t_first - seq.t_admit,
                decode_s=seq.t_end - t_first,
                ttft_s=t_first - seq.t_submit,
                preemptions=seq.preemptions,
            ),
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across every TP rank (what a tier copy moves)."""
        return self.engine.kv_block_bytes * self.settings.tensor_parallel_size

    def cache_stats(self) -> CacheStats:
        return self.manager.stats()

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill work not yet done: what the router's load penalty weighs."""
        waiting = sum(s.prefill_len for s in self.waiting)
        return waiting + sum(s.remaining_prefill for s in self.running if s.plan is not None)
