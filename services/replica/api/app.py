"""Builds the replica's FastAPI app around one engine and its core."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import torch
from fastapi import FastAPI

from cachepoint.engine import Engine, EngineConfig
from cachepoint.engine.device import resolve_device, resolve_dtype
from cachepoint.kvcore import monotonic_clock
from cachepoint.replica import watchdog
from cachepoint.replica.api.errors import install_error_handlers
from cachepoint.replica.api.routes import drain, generate, health, stats
from cachepoint.replica.bus import NatsBus
from cachepoint.replica.draining import CountInFlight, Drainer, InFlight
from cachepoint.replica.interface import EventSink, ReplicaCore
from cachepoint.replica.loop import TorchCore, engine_executor
from cachepoint.replica.metrics import ReplicaMetrics
from cachepoint.replica.random_config import random_model
from cachepoint.replica.random_model import load_random_tokenizer, random_context
from cachepoint.replica.requestlog import LOGGER, RequestLog
from cachepoint.replica.sequence import SequenceState
from cachepoint.replica.settings import ReplicaSettings
from cachepoint.runtime.serve import StartupError
from cachepoint.telemetry import Telemetry, configure, instrument_server

log = logging.getLogger(LOGGER)


def build_engine(settings: ReplicaSettings) -> Engine:
    if settings.kv_disk_path is not None:
        # NOTE: promised by the setting: a missing directory is made (a fresh emptyDir
        # or hostPath subdirectory), its parent was checked writable at start-up.
        settings.kv_disk_path.mkdir(parents=True, exist_ok=True)
    engine = _build_engine(settings)
    for tier, asked, slots in (
        ("kv_host_bytes", settings.kv_host_bytes, engine.host_kv_slots),
        ("kv_disk_bytes", settings.kv_disk_bytes, engine.disk_kv_slots),
    ):
        if asked and not slots:
            block = engine.kv_block_bytes * settings.tensor_parallel_size
            engine.close()
            raise ValueError(
                f"{tier}={asked} holds no whole KV block: one block of this model takes "
                f"{block} bytes over all {settings.tensor_parallel_size} TP rank(s)"
            )
    return engine


def _build_engine(settings: ReplicaSettings) -> Engine:
    config = EngineConfig(
        block_size=settings.block_size,
        device=settings.device,
        dtype=settings.dtype,
        kv_cache_bytes=settings.kv_cache_bytes,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_model_len=settings.max_model_len,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        tensor_parallel_size=settings.tensor_parallel_size,
        # NOTE: the settings size the tiers for the whole replica; each TP rank holds
        # its shard of every block, so each gets its share of the bytes.
        host_kv_bytes=settings.kv_host_bytes // settings.tensor_parallel_size,
        disk_kv_path=str(settings.kv_disk_path) if settings.kv_disk_path else None,
        disk_kv_bytes=settings.kv_disk_bytes // settings.tensor_parallel_size,
    )
    if settings.model_dir is not None:
        return Engine(config=config, model_dir=Path(settings.model_dir), seed=settings.seed)
    tokenizer = load_random_tokenizer(settings.tokenizer_path)
    model = random_model(settings.model_preset, tokenizer)
    if config.max_model_len is None and resolve_device(config.device).type == "cpu":
        dtype = str(resolve_dtype(config.dtype, torch.device("cpu"))).removeprefix("torch.")
        per_token = model.kv_bytes_per_token(dtype, config.tensor_parallel_size)
        config.max_model_len = random_context(
            model.max_position_embeddings, per_token, config.kv_cache_bytes, config.block_size
        )
    return Engine(model, config=config, seed=settings.seed, tokenizer=tokenizer)


async def _open_vllm(settings: ReplicaSettings, sink: EventSink | None) -> ReplicaCore:
    """The vLLM engine's core, its engine started (run only in vLLM's venv)."""
    # NOTE: imported here: these import vllm, which only .venv-vllm has; the torch
    # replica's app must load without it.
    from cachepoint.replica.vllm_engine.checkpoint import prepare
    from cachepoint.replica.vllm_engine.core import VllmCore

    checkpoint = await asyncio.to_thread(prepare, settings)
    core = VllmCore(settings, checkpoint, sink=sink)
    await core.open()
    return core


def create_app(
    settings: ReplicaSettings,
    engine: Engine | None = None,
    *,
    sink: EventSink | None = None,
    telemetry: Telemetry | None = None,
    clock: Callable[[], float] | None = None,
) -> FastAPI:
    """The app starts its scheduler on startup and stops it on shutdown; it drains on
    ``POST /v1/drain`` and, served by ``cachepoint.runtime.serve``, on SIGTERM (draining.py).

    Pass ``engine`` to share one across apps in tests; otherwise it is built from the
    settings (and closed on shutdown, which stops any TP workers). ``clock`` (torch
    engine, tests) is the monotonic clock TTLs run on: a test moves it to expire them.
    """

    tel = telemetry or configure(
        "cachepoint-replica", attributes={"cachepoint.replica": settings.name}
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = engine is None
        eng: Engine | None = None
        thread: ThreadPoolExecutor | None = None  # the torch engine's build-and-step thread
        scheduler: ReplicaCore
        try:
            if settings.engine == "vllm":
                scheduler = await _open_vllm(settings, sink)
            else:
                # NOTE: built on the thread that will step it (see engine_executor).
                thread = engine_executor(settings.name)
                loop = asyncio.get_running_loop()
                try:
                    eng = (
                        await loop.run_in_executor(thread, build_engine, settings)
                        if own
                        else engine
                    )
                    assert eng is not None
                    scheduler = TorchCore(
                        eng,
                        settings,
                        sink=sink,
                        engine_thread=thread,
                        clock=clock or monotonic_clock,
                    )
                except BaseException:
                    thread.shutdown(wait=False)
                    raise
        except (ValueError, RuntimeError) as exc:
            # NOTE: settings this machine cannot run (a KV budget too small for the
            # model, a block or head size vLLM refuses, vLLM failing to start): one
            # line saying so, not a traceback (cachepoint.runtime.serve prints it, exits 2).
            app.state.startup_error = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise StartupError(app.state.startup_error) from exc
        scheduler.tracer = tel.tracer
        metrics = ReplicaMetrics(scheduler)
        request_log = RequestLog(settings.name)

        def on_finish(seq: SequenceState) -> None:
            metrics.observe(seq)
            request_log(seq)

        scheduler.on_finish = on_finish
        watchdog.arm(scheduler, app.state)
        bus = None
        if settings.nats_url and sink is None:
            url = settings.advertise_url or f"http://{settings.host}:{settings.port}"
            bus = NatsBus(
                scheduler,
                settings.nats_url,
                url,
                heartbeat_interval_s=settings.heartbeat_interval_s,
                listening=getattr(app.state, "listening", None),
            )
            scheduler.sink = bus
            bus.tracer = tel.tracer
            await bus.start()
        drainer = Drainer(scheduler, in_flight, bus.announce if bus is not None else None)
        app.state.scheduler = scheduler
        app.state.metrics = metrics
        app.state.bus = bus
        app.state.drainer = drainer

        # NOTE: cachepoint.runtime.serve awaits this on SIGTERM before it stops the server, so a
        # local run (`cachepoint up`) or a pod without the preStop hook drains too.
        async def drain_on_exit() -> None:
            await drainer.drain(settings.drain_grace_s, why="SIGTERM")

        app.state.drain = drain_on_exit
        scheduler.start()
        log.info(
            "replica started",
            extra={
                "fields": {
                    "event": "replica_started",
                    "replica": settings.name,
                    "model": scheduler.model,
                    "epoch": scheduler.epoch,
                    "engine": settings.engine,
                    "blocks": scheduler.cache_stats().blocks.total,
                    "block_size": scheduler.block_size,
                    "max_model_len": scheduler.max_model_len,
                    "vocab_size": scheduler.vocab_size,
                    "tokenizer": settings.tokenizer if settings.model_dir is None else "checkpoint",
                    "device": scheduler.device,
                    "nats": bus is not None,
                }
            },
        )
        try:
            yield
        finally:
            await scheduler.stop()
            if thread is not None:
                thread.shutdown(wait=False)
            if bus is not None:
                await bus.stop()
            if own and eng is not None:
                eng.close()
            if telemetry is None:
                tel.shutdown()

    # NOTE: /docs, /redoc and /openapi.json only when asked for (api_docs): the
    # internal API is no one's to browse.
    docs = settings.api_docs
    app = FastAPI(
        title=f"Cachepoint replica {settings.name}",
        version="0.1.0",
        description="Internal API between the gateway and one replica.",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    install_error_handlers(app)
    for module in (generate, stats, drain, health):
        app.include_router(module.router)
    in_flight = InFlight()
    app.add_middleware(CountInFlight, counter=in_flight)
    instrument_server(app, tel)
    return app
