"""The torch engine's replica core: the loop that runs the policy's plans on the engine.

Like vLLM's EngineCore around its Scheduler: each turn asks the policy (policy.py) for
a `StepPlan`, traces and delivers what it decided (admissions, preemptions, endings),
runs its tier copies and its forward on the engine thread, hands the sampled tokens to
`SchedulerPolicy.update`, then commits and publishes finished prefills and streams the
tokens. `TorchCore` is the `ReplicaCore` the app builds around a torch `Engine`.

Threading model. Everything that touches kvcore runs on the asyncio event-loop
thread; only the engine's work (its forward pass, sampling and tier copies) runs on
one dedicated engine thread. While a step is in flight the loop does not change any
allocation the step reads: cancellations are flags that the loop acts on at the next
step boundary. That keeps kvcore lock-free and the block tables stable under the GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from cachepoint.engine import DecodeRequest, Engine, PrefillRequest, StopChecker
from cachepoint.engine.sampling import make_generator, sample_each
from cachepoint.kvcore import (
    BlockCopy,
    BlockHash,
    BlockPool,
    CacheStats,
    KVCacheManager,
    Tier,
    monotonic_clock,
)
from cachepoint.protocol import GenerateRequest, GenerateResponse, RetentionMode
from cachepoint.replica import admission, completion, intake, spans
from cachepoint.replica.admission import EntrySpan
from cachepoint.replica.errors import (
    CancelledRequestError,
    EngineFailedError,
    OverloadedError,
    ReplicaFailedError,
    failed_inside,
)
from cachepoint.replica.interface import CountingSink, DeathHook, EventSink, FinishHook
from cachepoint.replica.policy import EngineShape, SchedulerPolicy
from cachepoint.replica.rates import Rates
from cachepoint.replica.request_queue import RequestQueue
from cachepoint.replica.request_state import SeqStatus
from cachepoint.replica.sequence import PrefillDone, SequenceState
from cachepoint.replica.settings import ReplicaSettings
from cachepoint.replica.step import Admitted, Ending, Preemption, Sampled, StepPlan
from cachepoint.replica.stopping import TurnEnd, append_token

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineBatch:
    """A plan as the engine takes it: each chunk's engine request beside its sequence."""

    prefills: list[tuple[SequenceState, PrefillRequest]] = field(default_factory=list)
    decodes: list[tuple[SequenceState, DecodeRequest]] = field(default_factory=list)

    @classmethod
    def of(cls, plan: StepPlan[SequenceState]) -> EngineBatch:
        return cls(
            prefills=[
                (
                    c.seq,
                    PrefillRequest(
                        c.seq.prefill_tokens(c.end), c.block_ids, c.start, c.seq.arrival
                    ),
                )
                for c in plan.prefills
            ],
            decodes=[
                (c.seq, DecodeRequest(c.token, c.position, c.block_ids, seq_id=c.seq.arrival))
                for c in plan.decodes
            ],
        )


def engine_executor(name: str) -> ThreadPoolExecutor:
    """The one thread a replica's engine is built on and stepped on.

    NOTE: one and the same thread for both: torch keeps an OpenMP team per thread that
    runs a parallel op, and once a process's OpenMP threads outnumber its cores libgomp
    stops spinning between parallel regions and sleeps instead, so an engine built on
    one thread and stepped on another pays a futex wake per op (bench/RESULTS.md, "One
    torch thread per replica").
    """
    return ThreadPoolExecutor(1, thread_name_prefix=f"engine-{name}")


class TorchCore:
    """A replica on the torch engine: the policy's kvcore pool, the engine, the loop."""

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
        :func:`engine_executor`); the core runs every step on it, and whoever made it
        shuts it down. Default: a new one of the core's own."""
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
        shape = EngineShape(
            block_size=engine.block_size,
            num_blocks=blocks,
            host_blocks=engine.host_kv_slots,
            disk_blocks=engine.disk_kv_slots,
        )
        self.policy: SchedulerPolicy[SequenceState] = SchedulerPolicy(
            shape, settings, clock=clock, forget=engine.forget
        )
        self.rates = Rates()  # measured prefill and copy speeds, for the router
        self.copy_s = 0.0  # seconds the engine spent on tier copies, ever
        self.copied_blocks = 0  # blocks it copied between tiers, ever
        # NOTE: a fresh epoch per process start, monotonic across restarts, and a
        # `cleared` event to open it: consumers drop whatever they knew before.
        self.epoch = time.time_ns()
        self.manager.clear()
        self.sink: EventSink = sink or CountingSink()
        self.on_finish = on_finish
        self._arrivals = 0  # submissions so far: each sequence's arrival number
        self.steps = 0  # engine steps run, ever
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
        # Test hook: called with each non-empty plan outside every per-request guard, so
        # raising in it kills the loop (see watchdog.py).
        self.fault_hook: Callable[[StepPlan[SequenceState]], None] | None = None
        self.tracer: trace.Tracer = trace.NoOpTracer()  # set by the app when tracing is on

    # --------------------------------------------------------- the policy's

    @property
    def pool(self) -> BlockPool:
        return self.policy.pool

    @property
    def manager(self) -> KVCacheManager:
        return self.policy.manager

    @property
    def waiting(self) -> RequestQueue[SequenceState]:
        return self.policy.waiting

    @property
    def running(self) -> list[SequenceState]:
        return self.policy.running

    @property
    def preemptions(self) -> int:
        return self.policy.preemptions

    @property
    def queued_prefill_tokens(self) -> int:
        return self.policy.queued_prefill_tokens

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
    def retention(self) -> RetentionMode:
        return "guaranteed"  # kvcore's own pool retains entries' blocks

    @property
    def pinned_blocks(self) -> int | None:
        return None  # no connector: kvcore retains in its own pool (blocks.retained)

    @property
    def connector_seconds(self) -> float | None:
        return None  # no connector

    @property
    def expired_retentions(self) -> int | None:
        return None  # kvcore's pool does not count them

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def device(self) -> str:
        return str(self.engine.device)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block across every TP rank (what a tier copy moves)."""
        return self.engine.kv_block_bytes * self.settings.tensor_parallel_size

    def cache_stats(self) -> CacheStats:
        return self.manager.stats()

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
        self._settle_endings()
        for seq in [*self.waiting, *self.running]:
            self._finish(seq, error=OverloadedError("replica is shutting down"))
        self.flush_events()

    # ---------------------------------------------------------------- intake

    def submit(self, req: GenerateRequest) -> SequenceState:
        """Validate and queue a request. Raises InvalidRequestError or QueueFullError."""
        intake.refuse_if_closed(
            self.name, stopping=self._stopping, draining=self.draining, failure=self.failure
        )
        ok = intake.check(
            req,
            name=self.name,
            vocab_size=self.engine.vocab_size,
            max_model_len=self.max_model_len,
            waiting=len(self.waiting),
            max_waiting=self.settings.max_waiting,
            running_ids=self._ids,
        )
        schedule = admission.key_schedule(ok.key_spans)
        entry_spans = [
            EntrySpan(
                position=bp.position,
                ttl_label=bp.ttl,
                extra_keys=tuple(bp.extra_keys)
                if bp.extra_keys is not None
                else admission.keys_at_block(schedule, (bp.position - 1) // self.block_size),
                boundaries=tuple(bp.boundaries),
                owner=ok.owner,
            )
            for bp in req.breakpoints
        ]
        seq = SequenceState(
            request_id=ok.request_id,
            prompt=list(req.token_ids),
            key_spans=ok.key_spans,
            entry_spans=entry_spans,
            max_tokens=ok.params.max_tokens,
            params=ok.params,
            stream=asyncio.Queue(),
            done=asyncio.get_running_loop().create_future(),
            stopper=StopChecker(self.engine.tokenizer, ok.params.stop),
            generator=make_generator(ok.params, self.engine.device),
            otel_ctx=otel_context.get_current(),
            priority=req.priority,
            arrival=self._arrivals,
        )
        self._arrivals += 1
        self._ids.add(ok.request_id)
        self.policy.add(seq)
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
        with contextlib.suppress(Exception):
            self._settle_endings()
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

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._reap_cancelled()
            plan = self.policy.schedule(multi_step=self.fault_hook is None)
            self._settle(plan)
            if self.fault_hook is not None and not plan.empty:
                self.fault_hook(plan)
            if not await self._run_copies(plan.copies):
                self.flush_events()
                continue
            if plan.empty:
                self.flush_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = EngineBatch.of(plan)
            t0 = time.perf_counter()
            failed: Exception | None = None  # a later step of a run that failed
            try:
                if plan.decode_steps > 1:
                    steps, failed = await loop.run_in_executor(
                        self._engine_thread, self._forward_decodes, batch, plan.decode_steps
                    )
                else:
                    tokens = await loop.run_in_executor(
                        self._engine_thread, self._forward, batch, plan.sampled_prefills
                    )
                    steps = [tokens]
            except Exception as exc:  # the forward failed: every sequence in it fails
                log.warning("engine step failed: %s", exc)
                for seq in plan.seqs:
                    self._finish(seq, error=EngineFailedError(f"forward pass failed: {exc}"))
            else:
                self.steps += len(steps)
                dt = time.perf_counter() - t0
                self.rates.prefill(plan.computed_tokens, dt)
                if plan.prefills and plan.decodes:
                    for chunk in plan.decodes:
                        chunk.seq.decode_mixed_s += dt
                for tokens in steps:
                    try:
                        self._advance(plan, tokens)
                    except Exception as exc:  # not one sequence's: the step's output itself
                        for seq in plan.seqs:
                            self._fail(seq, exc)
                if failed is not None:  # the steps before it stand, as they would have
                    log.warning("engine step failed: %s", failed)
                    for seq in plan.seqs:
                        self._finish(seq, error=EngineFailedError(f"forward pass failed: {failed}"))
            self.flush_events()

    def _reap_cancelled(self) -> None:
        for seq in [s for s in (*self.waiting, *self.running) if s.cancelled]:
            self._finish(seq, error=CancelledRequestError("client disconnected"))

    # ------------------------------------------------ what the policy decided

    def _settle(self, plan: StepPlan[SequenceState]) -> None:
        """Trace and deliver what the policy did to requests on its way to ``plan``,
        in the order it did it."""
        for note in plan.notes:
            seq = note.seq
            if isinstance(note, Admitted):
                if seq.status is SeqStatus.FINISHED:
                    continue  # admitted by hand and ended since: nothing to trace
                try:
                    self._trace_admission(note)
                except Exception as exc:  # this request only
                    self._fail(seq, exc)
                    plan.drop(seq)
            elif isinstance(note, Preemption):
                if not note.committed:
                    attributes = functools.partial(self._prefill_attributes, computed=note.computed)
                    spans.end_prefill(seq, attributes, preempted=True)
                if seq.decode_span is not None:
                    output = {"cachepoint.output_tokens": len(seq.output)}
                    seq.decode_span.add_event("preempted", output)
            else:
                self._end(seq, note.error)

    def _settle_endings(self) -> None:
        """Deliver what the policy ended since its last plan (the loop will make no
        more plans): the rest of its notes are about requests failed next anyway."""
        for note in self.policy.take_notes():
            if isinstance(note, Ending):
                self._end(note.seq, note.error)

    def _trace_admission(self, note: Admitted[SequenceState]) -> None:
        seq, alloc = note.seq, note.alloc
        if note.resumed:
            seq.prefill_span = self.tracer.start_span("recompute", context=seq.otel_ctx)
        else:
            attributes: spans.Attributes = {
                "cachepoint.admit.hash_blocks": len(note.plan.block_hashes),
                "cachepoint.admit.engine_hit_tokens": alloc.num_cached_tokens,
                "cachepoint.admit.entry_hit_tokens": note.plan.entry_hit_tokens,
                "cachepoint.admit.queue_wait_s": seq.t_admit - seq.t_submit,
                "cachepoint.replica": self.name,
                "cachepoint.epoch": self.epoch,
            }
            spans.trace_admission(self.tracer, seq, attributes)
        if alloc.num_promoted_blocks and seq.prefill_span is not None:
            # A `promote` span inside the prefill: from admission until its copies ran.
            ctx = trace.set_span_in_context(seq.prefill_span, seq.otel_ctx)
            span = self.tracer.start_span("promote", context=ctx)
            block_bytes = self.block_bytes
            for tier, n in alloc.promoted_by_tier.items():
                span.set_attribute(f"cachepoint.promote.{tier}_blocks", n)
            span.set_attribute("cachepoint.promote.blocks", alloc.num_promoted_blocks)
            span.set_attribute("cachepoint.promote.bytes", alloc.num_promoted_blocks * block_bytes)
            seq.promote_span = span

    # ---------------------------------------------------------- tier copies

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

    async def _run_copies(self, copies: list[BlockCopy]) -> bool:
        """The copies queued since the last step; on failure every sequence whose
        promotion was among them fails (its blocks were never filled)."""
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

    # ------------------------------------------------------ the engine thread

    def _forward(self, batch: EngineBatch, finishing: list[int]) -> Sampled:
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

    def _forward_decodes(
        self, batch: EngineBatch, k: int
    ) -> tuple[list[Sampled], Exception | None]:
        """Up to ``k`` decode steps on the engine thread, each fed the tokens the last
        one sampled; stops early at a failed row or past ``multi_step_budget_s``.
        Returns each step's tokens, and what failed the forward of a step after the
        first (the first one's raises)."""
        steps: list[Sampled] = []
        deadline = time.perf_counter() + self.multi_step_budget_s
        for _ in range(k):
            try:
                tokens = self._forward(batch, [])
            except Exception as exc:
                if not steps:
                    raise
                return steps, exc
            steps.append(tokens)
            if isinstance(tokens, Exception) or len(steps) == k:
                break
            if time.perf_counter() >= deadline:
                break
            if any(isinstance(t, Exception) for t in tokens):
                break
            batch = EngineBatch(
                decodes=[
                    (seq, DecodeRequest(t, r.position + 1, r.block_table, seq_id=r.seq_id))
                    for (seq, r), t in zip(batch.decodes, tokens, strict=True)
                ]
            )
        return steps, None

    # ------------------------------------------------------ the step's output

    def _advance(self, plan: StepPlan[SequenceState], tokens: Sampled) -> None:
        """Commit finished prefills, append the sampled tokens. Whatever raises for one
        sequence (its commit, its sampling parameters, decoding its text) fails that one
        alone; a sampling failure of the whole batch fails its sampled rows."""
        update = self.policy.update(plan, tokens)
        for seq in update.prefilled:
            try:
                self._commit_prefill(seq)
            except Exception as exc:
                self._fail(seq, exc)
        for seq, token in update.sampled:
            if seq.status is SeqStatus.FINISHED:
                continue  # its commit failed above
            try:
                if isinstance(token, Exception):
                    raise token
                self._append_token(seq, token)
            except Exception as exc:
                self._fail(seq, exc)

    def _commit_prefill(self, seq: SequenceState) -> None:
        """Write-then-publish (the policy's commit), then the report goes out."""
        spans.end_prefill(seq, self._prefill_attributes)
        if seq.cache is not None:  # a recompute: its first commit's report stands
            self.policy.commit(seq)
            return
        with self.tracer.start_as_current_span("publish", context=seq.otel_ctx) as span:
            stored = self.policy.commit(seq)
            # Publish now, inside this span, so the NATS message carries its context.
            events = self.flush_events()
            assert seq.plan is not None
            span.set_attributes(
                {
                    "cachepoint.publish.blocks_stored": stored,
                    "cachepoint.publish.events": events,
                    "cachepoint.publish.entries_written": len(seq.plan.written),
                }
            )
        assert seq.cache is not None
        seq.t_first = time.perf_counter()
        spans.open_decode(self.tracer, seq)
        seq.stream.put_nowait(PrefillDone(seq.cache))

    def _append_token(self, seq: SequenceState, token: int) -> None:
        if append_token(seq, token, self._turn_end):
            self._finish(seq)

    # ------------------------------------------------------------- endings

    def _fail(self, seq: SequenceState, exc: Exception) -> None:
        """Something raised while handling ``seq``: it fails alone, the loop goes on."""
        if seq.status is SeqStatus.FINISHED:
            return
        log.error("request %s failed inside the replica", seq.request_id, exc_info=exc)
        self._finish(seq, error=failed_inside(self.name, exc))

    def _finish(self, seq: SequenceState, error: Exception | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        spans.close(seq, error, self._prefill_attributes)
        self.policy.finish(seq, keep_output=error is None and not seq.cancelled)
        completion.end_request(seq, error, ids=self._ids, on_finish=self.on_finish)

    def _end(self, seq: SequenceState, error: Exception | None) -> None:
        """Deliver the end of a request the policy already let go of."""
        spans.close(seq, error, self._prefill_attributes)
        completion.end_request(seq, error, ids=self._ids, on_finish=self.on_finish)

    def _prefill_attributes(
        self, seq: SequenceState, computed: int | None = None
    ) -> spans.Attributes:
        """The prefill span's attributes; ``computed``: the positions it had computed,
        where they are no longer ``seq.num_computed`` (a preemption reset them)."""
        hit = seq.alloc.num_cached_tokens if seq.alloc is not None else 0
        done = seq.num_computed if computed is None else computed
        return {
            "cachepoint.prefill.computed_tokens": done - hit,
            "cachepoint.prefill.cached_tokens": hit,
            "cachepoint.prefill.device": str(self.engine.device),
            "cachepoint.prefill.batch_size": seq.max_batch,
            "cachepoint.prefill.tensor_parallel_size": self.settings.tensor_parallel_size,
        }

    def flush_events(self) -> int:
        """Hand every pending kv event to the sink now; returns how many there were.
        Snapshots call this first; so does a commit, inside its `publish` span."""
        events = self.manager.take_events()
        if events:
            self.sink.publish(self.epoch, events)
        return len(events)

    # --------------------------------------------------------------- results

    def result(self, seq: SequenceState) -> GenerateResponse:
        return completion.response(seq, replica=self.name, epoch=self.epoch, model=self.model)
