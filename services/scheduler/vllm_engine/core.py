"""VllmScheduler: the replica's `ReplicaCore` over vLLM's engine.

vLLM admits, batches, computes and evicts; this class keeps what Cachepoint promises:

- the cache report: vLLM's per-request ``num_cached_tokens`` is the engine hit, and a
  managed entry is read only if vLLM reused the blocks under it (`MirrorCacheManager`);
  entries are written at the breakpoints past the read, as on the torch engine, but
  their retention is best effort: vLLM evicts by its own LRU, which nothing here pins;
- scope: the key spans fold into one ``cache_salt`` that is never weaker (scope.py);
- events: vLLM's KV events feed a kvcore `PoolMirror`, whose events go to the bus with
  this replica's epoch and sequence numbers, so routing treats it like any replica;
- the turn-end rule, stop strings and streamed text: the same code as the torch engine;
- restarts: a dead engine is rebuilt under a new epoch, its index announced cleared.

Threading: everything runs on the event loop, except building and shutting down the
engine (seconds to minutes), which happens in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from array import array
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from cachepoint.engine import SamplingParams, StopChecker
from cachepoint.kvcore import (
    MAX_LOOKBACK,
    BlockCounts,
    BlockHash,
    CacheStats,
    entry_key_at,
    hash_blocks,
    monotonic_clock,
)
from cachepoint.kvcore.mirror import MirrorCacheManager, PoolMirror

from .. import admission
from ..core import DeathHook, EventSink, FinishHook
from ..errors import (
    CancelledRequestError,
    DrainingError,
    InvalidRequestError,
    OverloadedError,
    QueueFullError,
    ReplicaFailedError,
    RequestFailedError,
)
from ..rates import Rates
from ..scheduler import CountingSink
from ..schemas import CacheReport, GenerateRequest, GenerateResponse, Timings
from ..sequence import PrefillDone, SeqStatus, SequenceState
from ..settings import ReplicaSettings
from ..stopping import TurnEnd, append_token
from . import events
from .checkpoint import Checkpoint
from .engine import VllmEngine, event_endpoints, sampling_params
from .scope import encode_salt, narrowed, salt_keys

log = logging.getLogger(__name__)

RETENTION_REASON = (
    "vLLM engine: entries are not pinned; vLLM's LRU may evict their blocks before the "
    "TTL, and an evicted entry is billed as a write again, never as a read"
)
WATCH_INTERVAL_S = 0.5


class VllmScheduler:
    """Drives one vLLM engine; owns the managed entries and the kvcore mirror."""

    def __init__(
        self,
        settings: ReplicaSettings,
        checkpoint: Checkpoint,
        *,
        sink: EventSink | None = None,
        clock: Any = monotonic_clock,
    ) -> None:
        self.settings = settings
        self.checkpoint = checkpoint
        self.name = settings.name
        self.model = settings.model_name
        self.tokenizer = checkpoint.tokenizer
        self.block_size = settings.block_size
        self.max_model_len = settings.max_model_len or 0
        self._turn_end = TurnEnd(
            checkpoint.eos_ids,
            checkpoint.eos_id,
            settings.random_turn_tokens if checkpoint.random else 0,
        )
        self._clock = clock
        self.mirror = PoolMirror(self.block_size)
        self.manager = MirrorCacheManager(self.mirror, clock=clock)
        self.epoch = time.time_ns()
        self.sink: EventSink = sink or CountingSink()
        self.engine: VllmEngine | None = None
        self.waiting: list[SequenceState] = []  # submitted, no output yet
        self.running: list[SequenceState] = []  # producing tokens
        self.preemptions = 0  # vLLM preempts internally and does not say: never counted
        self.copied_blocks = 0  # no kvcore tiers on this engine
        self.copy_s = 0.0
        self.rates = Rates()
        self.restarts = 0  # engine restarts since this process started
        self.draining = False
        self.failure: BaseException | None = None
        self.on_finish: FinishHook | None = None
        self.on_death: DeathHook | None = None
        self.fault_hook: Any = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        self._unavailable: str | None = "vLLM engine starting"
        self._stopping = False
        self._ids: set[str] = set()
        self._arrivals = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self._events_task: asyncio.Task[None] | None = None
        self._events_failed: BaseException | None = None

    # ------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Build the engine (in a worker thread) and subscribe to its KV events."""
        try:
            await self._start_engine()
        except RuntimeError as exc:
            # NOTE: vLLM logs the root cause from its engine process; its own exception
            # here only says that there is one.
            raise RuntimeError(
                f"vLLM's engine failed to start ({exc}); vLLM's log lines above say why"
            ) from exc

    def start(self) -> None:
        if self._watch_task is None:
            self._watch_task = asyncio.get_running_loop().create_task(
                self._watch(), name="vllm-watch"
            )

    @property
    def alive(self) -> bool:
        return self._watch_task is not None and not self._watch_task.done()

    @property
    def unavailable(self) -> str | None:
        return self._unavailable

    async def stop(self) -> None:
        self._stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch_task
        await self._fail_all(OverloadedError("replica is shutting down"))
        await self._close_engine()
        self.flush_events()

    async def _start_engine(self) -> None:
        endpoints = event_endpoints(self.name)
        engine = await asyncio.to_thread(VllmEngine, self.settings, self.checkpoint, endpoints)
        facts = engine.facts
        if facts.block_size != self.block_size:
            self.block_size = facts.block_size
            self.mirror = PoolMirror(facts.block_size)
            self.manager = MirrorCacheManager(self.mirror, clock=self._clock)
        self.max_model_len = facts.max_model_len
        self.engine = engine
        # NOTE: a new epoch per engine start, opened by `cleared`: whatever the gateway
        # knew of the previous engine's blocks is dropped (its KV died with it).
        self.manager.clear()
        self.epoch = time.time_ns()
        self.flush_events()
        ready = asyncio.Event()
        self._events_failed = None
        self._events_task = asyncio.create_task(self._events(endpoints, ready), name="vllm-kv")
        await ready.wait()
        self._unavailable = None
        log.info(
            "vLLM engine up",
            extra={
                "fields": {
                    "event": "vllm_engine_started",
                    "replica": self.name,
                    "epoch": self.epoch,
                    "vllm": facts.version,
                    "device": facts.device,
                    "blocks": facts.num_blocks,
                    "block_size": facts.block_size,
                    "max_model_len": facts.max_model_len,
                    "pids": engine.pids(),
                }
            },
        )

    async def _close_engine(self) -> None:
        task, self._events_task = self._events_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)

    async def _events(
        self, endpoints: tuple[str, str], ready: asyncio.Event, *, from_start: bool = True
    ) -> None:
        try:
            await events.subscribe(
                endpoints[0], endpoints[1], self._on_vllm_events, ready=ready, from_start=from_start
            )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a gap vLLM could not replay, or ZMQ failed
            self._events_failed = exc
            ready.set()

    def _on_vllm_events(self, batch: list[Any]) -> None:
        applied = events.apply(self.mirror, batch)
        if applied.cleared:  # vLLM dropped its whole cache: no entry can be read now
            self.manager.lapse_all()
        self.manager.lapse(applied.removed)
        self.flush_events()

    async def _watch(self) -> None:
        """Restart a dead engine; resync a mirror that lost events."""
        while not self._stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            engine = self.engine
            if engine is not None and engine.errored:
                await self._restart("the engine died")
            elif self._events_failed is not None:
                self._resync(self._events_failed)

    async def _restart(self, why: str) -> None:
        self._unavailable = f"vLLM engine restarting: {why}"
        log.warning(
            "vLLM engine restarting",
            extra={"fields": {"event": "vllm_engine_restart", "replica": self.name, "why": why}},
        )
        await self._fail_all(
            ReplicaFailedError(f"replica {self.name} failed: {why}; retry on another replica")
        )
        await self._close_engine()
        while not self._stopping:
            try:
                await self._start_engine()
                break
            except Exception:
                log.exception("vLLM engine failed to start again; retrying in 5 s")
                await asyncio.sleep(5.0)
        self.restarts += 1

    def _resync(self, exc: BaseException) -> None:
        """The mirror missed events: start it over under a new epoch. It then knows less
        than vLLM holds (routing finds fewer hits here until prefixes are stored
        again), never more; billing does not depend on it."""
        log.warning("vLLM KV events lost (%s); the mirror starts over", exc)
        # NOTE: the entries stay: a read depends on vLLM's own reuse, never on the
        # mirror, so an entry whose blocks vLLM still holds is still read (and billed)
        # as one.
        self.manager.mirror.cleared()
        self.epoch = time.time_ns()
        self.flush_events()
        endpoints = event_endpoints(self.name)
        ready = asyncio.Event()
        self._events_failed = None
        self._events_task = asyncio.create_task(
            self._events(endpoints, ready, from_start=False), name="vllm-kv"
        )

    # ---------------------------------------------------------------- intake

    def submit(self, req: GenerateRequest) -> SequenceState:
        if self._stopping:
            raise OverloadedError(f"replica {self.name} is shutting down")
        if self.draining:
            raise DrainingError(
                f"replica {self.name} is draining: it takes no new requests; retry on "
                "another replica"
            )
        if self._unavailable is not None or self.engine is None:
            raise OverloadedError(f"replica {self.name}: {self._unavailable}")
        n = len(req.token_ids)
        vocab = self.vocab_size
        for field, ids in (("token_ids", req.token_ids), ("stop_token_ids", req.stop_token_ids)):
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"{field}.{bad}: {ids[bad]} is not a token id (0..{vocab - 1})"
                )
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt of {n} tokens leaves no room to generate: max_model_len is "
                f"{self.max_model_len}"
            )
        if len(self.waiting) >= self.settings.max_waiting:
            raise QueueFullError(
                f"{len(self.waiting)} requests already waiting on replica {self.name}"
            )
        request_id = req.request_id or f"req_{uuid.uuid4().hex}"
        if request_id in self._ids:
            raise InvalidRequestError(f"request_id {request_id} is already running here")
        try:
            params = SamplingParams(
                max_tokens=min(req.max_tokens, self.max_model_len - n),
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
        keys = salt_keys(spans)
        tokens = array("i", req.token_ids)
        hashes = hash_blocks(tokens, self.block_size, keys)
        owner = admission.retention_owner(req.retention_owner, req.owner_retained_share)
        # NOTE: every entry is keyed under the salt's keys: on vLLM a global marker's
        # prefix is org-private too (scope.py), and so is its entry.
        bps = [
            admission.Breakpoint(
                position=bp.position,
                ttl_label=bp.ttl,
                extra_keys=keys,
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
            stopper=StopChecker(self.tokenizer, params.stop),
            otel_ctx=otel_context.get_current(),
            priority=req.priority,
            arrival=self._arrivals,
        )
        seq.plan = admission.CachePlan(tokens, hashes, sorted(bps, key=lambda b: b.position))
        self._arrivals += 1
        self._ids.add(request_id)
        self.waiting.append(seq)
        seq.t_admit = seq.t_submit  # vLLM queues internally; the wait counts as prefill
        self._trace_admit(seq, len(hashes), narrowed(spans))
        seq.prefill_span = self.tracer.start_span("prefill", context=seq.otel_ctx)
        vparams = sampling_params(
            max_tokens=self._vllm_max_tokens(params),
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop_token_ids=sorted(
                set(params.stop_token_ids)
                | (set() if params.ignore_eos else set(self._turn_end.eos_ids))
            ),
        )
        salt = encode_salt(keys)
        self._tasks[request_id] = loop.create_task(
            self._run(seq, salt, vparams, narrowed(spans)), name=f"vllm-{request_id}"
        )
        return seq

    def _vllm_max_tokens(self, params: SamplingParams) -> int:
        turn = self._turn_end.random_turn
        # NOTE: the random model's turn ends at its N-th token (append_token makes it
        # EOS), so vLLM need not compute past it.
        if turn and not params.ignore_eos:
            return min(params.max_tokens, turn)
        return params.max_tokens

    def cancel(self, seq: SequenceState) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        seq.cancelled = True
        task = self._tasks.get(seq.request_id)
        if task is not None and not task.done():
            task.cancel()

    # ------------------------------------------------------------- a request

    async def _run(self, seq: SequenceState, salt: str | None, vparams: Any, narrow: bool) -> None:
        engine = self.engine
        assert engine is not None
        stream = engine.generate(seq.prompt, salt, vparams, seq.request_id, seq.priority)
        try:
            async for out in stream:
                if seq.cache is None:
                    self._commit_prefill(seq, int(out.num_cached_tokens or 0), narrow)
                for token in out.outputs[0].token_ids if out.outputs else ():
                    if append_token(seq, int(token), self._turn_end):
                        break
                if seq.stop_reason is not None:
                    break
                if out.finished:
                    # NOTE: vLLM stops on exactly the ids and limit the rule above does,
                    # so it never ends a turn the rule has not: if it did, say so.
                    raise RequestFailedError(
                        f"vLLM ended request {seq.request_id} before its turn ended"
                    )
            if seq.stop_reason is None:
                raise RequestFailedError(f"vLLM's stream for {seq.request_id} ended early")
        except asyncio.CancelledError:
            self._finish(seq, CancelledRequestError("client disconnected"))
            return
        except Exception as exc:
            self._finish(seq, self._error(seq, exc))
            return
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # type: ignore[attr-defined]
            self._tasks.pop(seq.request_id, None)
        self._finish(seq)

    def _error(self, seq: SequenceState, exc: Exception) -> Exception:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError):
            return ReplicaFailedError(
                f"replica {self.name} failed: the vLLM engine died; retry on another replica"
            )
        if isinstance(exc, RequestFailedError):
            return exc
        log.error("request %s failed in vLLM", seq.request_id, exc_info=exc)
        return RequestFailedError(
            f"request failed inside replica {self.name}: {type(exc).__name__}: {exc}"
        )

    def _commit_prefill(self, seq: SequenceState, engine_hit: int, narrow: bool) -> None:
        """The first output: vLLM has reused ``engine_hit`` tokens and computed the rest.
        Read the longest entry vLLM really reused, write the breakpoints past it."""
        plan = seq.plan
        assert plan is not None
        n = seq.prompt_len
        hit = max(0, min(engine_hit, n - 1)) // self.block_size * self.block_size
        self.manager.count_query(n, hit)
        with self.tracer.start_as_current_span("publish", context=seq.otel_ctx) as span:
            for bp in plan.breakpoints:
                positions = (bp.position, *bp.boundaries)[:MAX_LOOKBACK]
                keys = [
                    entry_key_at(plan.tokens, p, plan.block_hashes, self.block_size, bp.extra_keys)
                    for p in positions
                ]
                found = self.manager.lookup_entry(keys, hit, n)
                if found is not None and found.num_tokens > plan.entry_hit_tokens:
                    plan.entry_hit_tokens = found.num_tokens
                    plan.entry_hit_lookback = found.lookback
            for bp in plan.breakpoints:
                if bp.position <= plan.entry_hit_tokens:
                    continue
                key = entry_key_at(
                    plan.tokens, bp.position, plan.block_hashes, self.block_size, bp.extra_keys
                )
                self.manager.write_entry(key, bp.position, plan.block_hashes, bp.ttl_s)
                plan.written.append((bp.position, bp.ttl_label))
            published = self.flush_events()
            span.set_attributes(
                {
                    "cachepoint.publish.events": published,
                    "cachepoint.publish.entries_written": len(plan.written),
                    "cachepoint.engine": "vllm",
                }
            )
        w5m, w1h = admission.written_tokens(plan)
        seq.cache = CacheReport(
            prompt_tokens=n,
            engine_hit_tokens=hit,
            computed_tokens=n - hit,
            entry_hit_tokens=plan.entry_hit_tokens,
            entry_hit_lookback=plan.entry_hit_lookback,
            written_5m_tokens=w5m,
            written_1h_tokens=w1h,
            retention_refused=False,
            retention="best_effort",
            retention_reason=RETENTION_REASON,
            scope_narrowed=narrow,
        )
        seq.t_first = time.perf_counter()
        self.rates.prefill(n - hit, seq.t_first - seq.t_submit)
        self._end_prefill_span(seq, None)
        seq.decode_span = self.tracer.start_span("decode", context=seq.otel_ctx)
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.running.append(seq)
        seq.status = SeqStatus.DECODING
        seq.stream.put_nowait(PrefillDone(seq.cache))

    def _finish(self, seq: SequenceState, error: Exception | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        with contextlib.suppress(Exception):
            self._close_spans(seq, error)
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.t_end = time.perf_counter()
        self._ids.discard(seq.request_id)
        seq.stream.put_nowait(None)
        if not seq.done.done():
            if error is None:
                seq.done.set_result(None)
            else:
                seq.done.set_exception(error)
                seq.done.exception()  # retrieved: a vanished client may never await it
        if self.on_finish is not None:
            try:
                self.on_finish(seq)
            except Exception:
                log.exception("on_finish hook failed for %s", seq.request_id)

    async def _fail_all(self, error: Exception) -> None:
        for seq in [*self.waiting, *self.running]:
            # NOTE: finished first, so the task's own CancelledError handler (a no-op on
            # a finished request) cannot be what reports why it ended.
            self._finish(seq, error)
            task = self._tasks.pop(seq.request_id, None)
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    # ---------------------------------------------------------------- tracing

    def _trace_admit(self, seq: SequenceState, blocks: int, narrow: bool) -> None:
        span = self.tracer.start_span("admit", context=seq.otel_ctx, start_time=seq.t_submit_ns)
        span.set_attributes(
            {
                "cachepoint.admit.hash_blocks": blocks,
                "cachepoint.admit.scope_narrowed": narrow,
                "cachepoint.replica": self.name,
                "cachepoint.epoch": self.epoch,
                "cachepoint.engine": "vllm",
            }
        )
        span.end()

    def _end_prefill_span(self, seq: SequenceState, error: Exception | None) -> None:
        span: Span | None
        span, seq.prefill_span = seq.prefill_span, None
        if span is None:
            return
        cache = seq.cache
        span.set_attributes(
            {
                "cachepoint.prefill.computed_tokens": cache.computed_tokens if cache else 0,
                "cachepoint.prefill.cached_tokens": cache.engine_hit_tokens if cache else 0,
                "cachepoint.prefill.device": self.device,
                "cachepoint.engine": "vllm",
            }
        )
        if error is not None:
            span.set_attribute("cachepoint.aborted", True)
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end()

    def _close_spans(self, seq: SequenceState, error: Exception | None) -> None:
        self._end_prefill_span(seq, error or CancelledRequestError("finished before commit"))
        if seq.decode_span is not None:
            seq.decode_span.set_attribute("gen_ai.usage.output_tokens", len(seq.output))
            if error is not None:
                seq.decode_span.record_exception(error)
                seq.decode_span.set_status(Status(StatusCode.ERROR, str(error)))
            seq.decode_span.end()
            seq.decode_span = None

    # ------------------------------------------------------------- reporting

    def flush_events(self) -> int:
        evs = self.manager.mirror.take_events()
        if evs:
            self.sink.publish(self.epoch, evs)
        return len(evs)

    def snapshot(self) -> dict[str, list[BlockHash]]:
        return {"device": list(self.mirror.cached)}

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
            ),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return self.engine.facts.kv_bytes_per_token if self.engine else 0

    @property
    def lapsed_entries(self) -> int:
        return self.manager.lapsed_entries

    @property
    def vocab_size(self) -> int:
        return self.checkpoint.vocab_size

    @property
    def device(self) -> str:
        return self.engine.facts.device if self.engine else "cpu"

    @property
    def block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    @property
    def queued_prefill_tokens(self) -> int:
        return sum(s.prompt_len for s in self.waiting)

    def cache_stats(self) -> CacheStats:
        st = self.manager.stats()
        total = self.engine.facts.num_blocks if self.engine else 0
        # NOTE: vLLM does not report its block states to the shim: "active" is what the
        # running requests hold (shared prefixes counted once per request, so an upper
        # bound), "cached" what its KV events say is hittable.
        b = self.block_size
        active = min(total, sum(-(-(s.prompt_len + len(s.output)) // b) for s in self.running))
        cached = min(st.cached_blocks, total - active)
        return CacheStats(
            blocks=BlockCounts(
                total=total,
                active=active,
                cached_free=cached,
                empty=total - active - cached,
                retained=0,
                max_retained=0,
            ),
            entries=st.entries,
            query_tokens=st.query_tokens,
            hit_tokens=st.hit_tokens,
            evictions=0,
            retain_refusals=0,
            quota_refusals=0,
        )
