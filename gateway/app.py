"""Builds the gateway's FastAPI app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

from cachepoint.telemetry import Telemetry, configure, instrument_server
from cachepoint.tokenizer import load_tokenizer

from .api import errors
from .api.middleware import RequestIdMiddleware
from .api.routes import health, messages, models, reports
from .bus import GatewayBus
from .contract.render import Renderer
from .db.migrate import upgrade
from .db.session import make_engine, make_sessionmaker
from .directory import ReplicaDirectory
from .routing import DirectoryRouter
from .settings import GatewaySettings
from .state import GatewayState
from .upstream import Router


def create_app(
    settings: GatewaySettings,
    router: Router | None = None,
    *,
    telemetry: Telemetry | None = None,
) -> FastAPI:
    """The app migrates the database on startup. Pass ``router`` to choose replicas some
    other way than the directory's policy, and ``telemetry`` to trace somewhere other
    than the CACHEPOINT_TELEMETRY_* settings say."""
    tel = telemetry or configure("cachepoint-gateway")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.database_url)
        upgrade(engine)
        timeout = httpx.Timeout(settings.upstream_timeout_s, connect=5.0)
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
            if tel.enabled:
                HTTPXClientInstrumentor().instrument_client(http, tracer_provider=tel.provider)
            directory = ReplicaDirectory(heartbeat_interval_s=settings.heartbeat_interval_s)
            bus = GatewayBus(directory, settings.nats_url, http, seed_urls=settings.replica_urls)
            chosen = router or DirectoryRouter(
                directory,
                http,
                settings.routing_policy,
                settings.block_size,
                nats_up=lambda: bus.connected,
            )
            app.state.gateway = GatewayState(
                settings=settings,
                sessions=make_sessionmaker(engine),
                renderer=Renderer(load_tokenizer(settings.model_dir)),
                router=chosen,
                tracer=tel.tracer,
            )
            app.state.gateway.served_models = lambda: {
                st.model for st in directory.replicas.values() if st.view.live and st.model
            }
            app.state.directory = directory
            app.state.bus = bus
            app.state.gateway.metrics.watch_plane(
                lambda: {
                    "lag_s": bus.lag_s,
                    "resyncs": directory.resyncs,
                    "heartbeat_misses": directory.heartbeat_misses,
                    "live": sum(v.live for v in directory.views()),
                }
            )
            bus.tracer = tel.tracer
            await bus.start()
            try:
                yield
            finally:
                await bus.stop()
                engine.dispose()
                if telemetry is None:
                    tel.shutdown()

    app = FastAPI(
        title="Cachepoint gateway",
        version="0.1.0",
        description="Anthropic-compatible Messages API with managed prompt caching.",
        lifespan=lifespan,
    )
    errors.install(app)
    for module in (messages, models, reports, health):
        app.include_router(module.router)
    app.add_middleware(RequestIdMiddleware, max_body_bytes=settings.max_body_bytes)
    instrument_server(app, tel)
    return app
