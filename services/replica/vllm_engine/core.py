"""VllmCore: the replica's `ReplicaCore` over vLLM's engine.

vLLM admits, batches, computes and evicts; this class keeps what Cachepoint promises:

- the cache report: vLLM's per-request ``num_cached_tokens`` is the engine hit, and a
  managed entry is read only if vLLM reused the blocks under it (`MirrorCacheManager`);
  entries are written at the breakpoints past the read, as on the torch engine;
- retention: kvcore's `PinLedger` grants each entry's blocks (share cap, org quotas)
  before vLLM sees the request, and the retention connector inside vLLM pins what was
  granted (retention.py, pins.py, retention_connector.py); without the connector,
  retention is best effort (vLLM's LRU);
- scope: the key spans fold into one ``cache_salt`` that is never weaker (scope.py);
- events: vLLM's KV events feed a kvcore `PoolMirror`, whose events go to the bus with
  this replica's epoch and sequence numbers, so routing treats it like any replica;
- the turn-end rule, stop strings and streamed text, intake checks and sampling
  parameters, spans, a request's end and its response: the same code as the torch
  engine's (stopping.py, intake.py, spans.py, completion.py);
- restarts: a dead engine is rebuilt under a new epoch, its index announced cleared.

Threading: everything runs on the event loop, except building and shutting down the
engine (seconds to minutes), which happens in a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from cachepoint.engine import SamplingParams, StopChecker
from cachepoint.kvcore import (
    MAX_LOOKBACK_BOUNDARIES,
    BlockCounts,
    BlockHash,
    CacheStats,
    PinLedger,
    entry_key_at,
    hash_blocks,
    monotonic_clock,
)
from cachepoint.kvcore.mirror import MirrorCacheManager, PoolMirror
from cachepoint.protocol import CacheReport, GenerateRequest, GenerateResponse, RetentionMode
from cachepoint.replica import admission, completion, intake, spans
from cachepoint.replica.errors import (
    CancelledRequestError,
    OverloadedError,
    ReplicaFailedError,
    RequestFailedError,
    failed_inside,
)
from cachepoint.replica.interface import CountingSink, DeathHook, EventSink, FinishHook
from cachepoint.replica.rates import Rates
from cachepoint.replica.request_state import SeqStatus
from cachepoint.replica.sequence import PrefillDone, SequenceState
from cachepoint.replica.settings import ReplicaSettings
from cachepoint.replica.stopping import TurnEnd, append_token
from cachepoint.replica.vllm_engine import events
from cachepoint.replica.vllm_engine.checkpoint import Checkpoint
from cachepoint.replica.vllm_engine.engine import VllmEngine, event_endpoints, sampling_params
from cachepoint.replica.vllm_engine.pins import PARAMS_KEY
from cachepoint.replica.vllm_engine.retention import PinPlan, extend_at_end, plan_pins
from cachepoint.replica.vllm_engine.scope import encode_salt, narrowed, salt_keys

log = logging.getLogger(__name__)

RETENTION_REASON = (
    "vLLM engine without the retention connector (--no-vllm-retention): entries are not "
    "pinned; vLLM's LRU may evict their blocks before the TTL, and an evicted entry is "
    "billed as a write again, never as a read"
)
WATCH_INTERVAL_S = 0.5


class VllmCore:
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
        self.ledger = self._new_ledger(0)  # sized to vLLM's pool once it is up
        self._pin_plans: dict[str, PinPlan] = {}  # request id -> its grants, until its end
        self.pinned_blocks = 0  # distinct blocks vLLM's connector holds, as it last said
        self.connector_error: str | None = None  # the connector's, once it broke
        self.connector_seconds: float | None = None  # its scheduler-side time, as it said
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

    def _new_ledger(self, num_blocks: int) -> PinLedger:
        return PinLedger(
            num_blocks,
            retained_share=self.settings.retained_share,
            owner_share=self.settings.org_retained_share,
            clock=self._clock,
        )

    @property
    def retaining(self) -> bool:
        """Does vLLM run the retention connector (entries are pinned)?"""
        engine = self.engine
        return (
            self.settings.vllm_retention
            and engine is not None
            and engine.facts.connector is not None
            and self.connector_error is None
        )

    def _best_effort_reason(self) -> str:
        if self.connector_error is not None:
            return (
                f"vLLM's retention connector stopped ({self.connector_error}): entries are "
                "not pinned until the engine restarts; an evicted entry is billed as a write "
                "again, never as a read"
            )
        return RETENTION_REASON

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
        # knew of the previous engine's blocks is dropped (its KV died with it), and so
        # is every pin (they were references in the dead engine's pool).
        self.manager.clear()
        self.ledger = self._new_ledger(facts.num_blocks)
        self.pinned_blocks = 0
        self.connector_error = None
        self.connector_seconds = None
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
            self.ledger.clear()  # its reset released every pin first (engine.py)
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
        intake.refuse_if_closed(
            self.name, stopping=self._stopping, draining=self.draining, failure=self.failure
        )
        if self._unavailable is not None or self.engine is None:
            raise OverloadedError(f"replica {self.name}: {self._unavailable}")
        ok = intake.check(
            req,
            name=self.name,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            waiting=len(self.waiting),
            max_waiting=self.settings.max_waiting,
            running_ids=self._ids,
        )
        params, request_id, key_spans = ok.params, ok.request_id, ok.key_spans
        keys = salt_keys(key_spans)
        tokens = array("i", req.token_ids)
        hashes = hash_blocks(tokens, self.block_size, keys)
        # NOTE: every entry is keyed under the salt's keys: on vLLM a global marker's
        # prefix is org-private too (scope.py), and so is its entry.
        entry_spans = [
            admission.EntrySpan(
                position=bp.position,
                ttl_label=bp.ttl,
                extra_keys=keys,
                boundaries=tuple(bp.boundaries),
                owner=ok.owner,
            )
            for bp in req.breakpoints
        ]
        loop = asyncio.get_running_loop()
        seq = SequenceState(
            request_id=request_id,
            prompt=list(req.token_ids),
            key_spans=key_spans,
            entry_spans=entry_spans,
            max_tokens=params.max_tokens,
            params=params,
            stream=asyncio.Queue(),
            done=loop.create_future(),
            stopper=StopChecker(self.tokenizer, params.stop),
            otel_ctx=otel_context.get_current(),
            priority=req.priority,
            arrival=self._arrivals,
        )
        seq.plan = admission.AdmissionPlan(
            tokens, hashes, sorted(entry_spans, key=lambda b: b.position)
        )
        transfer = None
        if self.retaining:
            pins = plan_pins(self.ledger, seq.plan, self.block_size, self.settings.ttl_scale)
            self._pin_plans[request_id] = pins
            transfer = pins.params()
        self._arrivals += 1
        self._ids.add(request_id)
        self.waiting.append(seq)
        seq.t_admit = seq.t_submit  # vLLM queues internally; the wait counts as prefill
        admit: spans.Attributes = {
            "cachepoint.admit.hash_blocks": len(hashes),
            "cachepoint.admit.scope_narrowed": narrowed(key_spans),
            "cachepoint.replica": self.name,
            "cachepoint.epoch": self.epoch,
            "cachepoint.engine": "vllm",
        }
        spans.trace_admission(self.tracer, seq, admit)
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
            kv_transfer_params=transfer,
        )
        salt = encode_salt(keys)
        self._tasks[request_id] = loop.create_task(
            self._run(seq, salt, vparams, narrowed(key_spans)), name=f"vllm-{request_id}"
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
                    if out.finished:
                        self._connector_said(out)
                    break
                if out.finished:
                    self._connector_said(out)
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

    def _connector_said(self, out: Any) -> None:
        """The connector's report on a finished request (pins.FinishReport)."""
        ours = (getattr(out, "kv_transfer_params", None) or {}).get(PARAMS_KEY)
        if not ours:
            return
        if "error" in ours:
            if self.connector_error is None:
                log.error("vLLM retention connector: %s; retention is best effort now", ours)
            self.connector_error = str(ours["error"])
            return
        self.pinned_blocks = int(ours.get("pinned_blocks", self.pinned_blocks))
        self.connector_seconds = float(ours.get("seconds", self.connector_seconds or 0.0))

    def _error(self, seq: SequenceState, exc: Exception) -> Exception:
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError):
            return ReplicaFailedError(
                f"replica {self.name} failed: the vLLM engine died; retry on another replica"
            )
        if isinstance(exc, RequestFailedError):
            return exc
        log.error("request %s failed in vLLM", seq.request_id, exc_info=exc)
        return failed_inside(self.name, exc)

    def _commit_prefill(self, seq: SequenceState, engine_hit: int, narrow: bool) -> None:
        """The first output: vLLM has reused ``engine_hit`` tokens and computed the rest.
        Read the longest entry vLLM really reused, write the breakpoints past it."""
        plan = seq.plan
        assert plan is not None
        n = seq.prompt_len
        hit = max(0, min(engine_hit, n - 1)) // self.block_size * self.block_size
        self.manager.count_query(n, hit)
        with self.tracer.start_as_current_span("publish", context=seq.otel_ctx) as span:
            for bp in plan.entry_spans:
                positions = (bp.position, *bp.boundaries)[:MAX_LOOKBACK_BOUNDARIES]
                keys = [
                    entry_key_at(plan.tokens, p, plan.block_hashes, self.block_size, bp.extra_keys)
                    for p in positions
                ]
                found = self.manager.lookup_entry(keys, hit, n)
                if found is not None and found.num_tokens > plan.entry_hit_tokens:
                    plan.entry_hit_tokens = found.num_tokens
                    plan.entry_hit_lookback = found.lookback
            pins = self._pin_plans.get(seq.request_id)
            for bp in plan.entry_spans:
                if bp.position <= plan.entry_hit_tokens:
                    continue
                if pins is not None and not pins.retained(bp.position):
                    # NOTE: not retained, so not a write: billed as plain input, as a
                    # refused retain is on the torch engine.
                    plan.refusal_reason = pins.reason
                    break
                key = entry_key_at(
                    plan.tokens, bp.position, plan.block_hashes, self.block_size, bp.extra_keys
                )
                ttl = bp.ttl_s * self.settings.ttl_scale
                self.manager.write_entry(key, bp.position, plan.block_hashes, ttl)
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
            retention_refused=plan.refusal_reason is not None,
            refusal_reason=plan.refusal_reason,
            retention="guaranteed" if pins is not None else "best_effort",
            retention_reason=None if pins is not None else self._best_effort_reason(),
            scope_narrowed=narrow,
        )
        seq.t_first = time.perf_counter()
        self.rates.prefill(n - hit, seq.t_first - seq.t_submit)
        spans.end_prefill(seq, self._prefill_attributes)
        spans.open_decode(self.tracer, seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.running.append(seq)
        seq.status = SeqStatus.DECODING
        seq.stream.put_nowait(PrefillDone(seq.cache))

    def _finish(self, seq: SequenceState, error: Exception | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        spans.close(seq, error, self._prefill_attributes)
        pins = self._pin_plans.pop(seq.request_id, None)
        if pins is not None:
            extend_at_end(self.ledger, pins)
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        completion.end_request(seq, error, ids=self._ids, on_finish=self.on_finish)

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

    def _prefill_attributes(self, seq: SequenceState) -> spans.Attributes:
        cache = seq.cache
        return {
            "cachepoint.prefill.computed_tokens": cache.computed_tokens if cache else 0,
            "cachepoint.prefill.cached_tokens": cache.engine_hit_tokens if cache else 0,
            "cachepoint.prefill.device": self.device,
            "cachepoint.engine": "vllm",
        }

    # ------------------------------------------------------------- reporting

    def flush_events(self) -> int:
        evs = self.manager.mirror.take_events()
        if evs:
            self.sink.publish(self.epoch, evs)
        return len(evs)

    def snapshot(self) -> dict[str, list[BlockHash]]:
        return {"device": list(self.mirror.cached)}

    def result(self, seq: SequenceState) -> GenerateResponse:
        return completion.response(seq, replica=self.name, epoch=self.epoch, model=self.model)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.engine.facts.kv_bytes_per_token if self.engine else 0

    @property
    def lapsed_entries(self) -> int:
        return self.manager.lapsed_entries

    @property
    def expired_retentions(self) -> int | None:
        return self.ledger.stats().expired

    @property
    def retention(self) -> RetentionMode:
        return "guaranteed" if self.retaining else "best_effort"

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
        pins = self.ledger.stats()
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
                retained=pins.retained,
                max_retained=pins.max_retained,
                retained_owners=pins.owners,
            ),
            entries=st.entries,
            query_tokens=st.query_tokens,
            hit_tokens=st.hit_tokens,
            evictions=0,
            retain_refusals=pins.refusals,
            quota_refusals=pins.quota_refusals,
        )
