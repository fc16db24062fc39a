"""Builds the gateway's FastAPI app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

from cachepoint.gateway.api import errors, openapi
from cachepoint.gateway.api.middleware import RequestIdMiddleware
from cachepoint.gateway.api.routes import admin, health, messages, models, openai, reports
from cachepoint.gateway.contract.template import build_renderer, checkpoint_context_window
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.fleet.bus import event_plane
from cachepoint.gateway.fleet.routing import DirectoryRouter, Router
from cachepoint.gateway.fleet.upstream import ReplicaSession
from cachepoint.gateway.observability.metrics import listen
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.state import GatewayState
from cachepoint.telemetry import Telemetry, configure, instrument_server

# NOTE: a pod may start before its database; wait this long for it, inside the chart's
# startup probe budget (30 x 5 s), then fail the start with a clear error.
DATABASE_WAIT_S = 120.0


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
    window = checkpoint_context_window(settings.model_dir)
    if window and "max_context_tokens" not in settings.model_fields_set:
        # NOTE: a real checkpoint's context length is its window unless one is set.
        settings = settings.model_copy(update={"max_context_tokens": window})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_engine(settings.database_url)
        # NOTE: blocking is fine here: nothing is served before startup ends. One pod of
        # several migrates, the others wait on its lock (db/migrate.py).
        upgrade(engine, wait_s=DATABASE_WAIT_S)
        timeout = httpx.Timeout(settings.upstream_timeout_s, connect=5.0)
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        # NOTE: these clients talk only to replicas (httpx: the stats and readiness polls;
        # ReplicaSession: generate calls), so the internal token rides on every call from
        # one place rather than at each call site.
        token = settings.internal_token
        headers = {"authorization": f"Bearer {token.get_secret_value()}"} if token else None
        replicas = ReplicaSession(
            settings.upstream_timeout_s, headers, tel.provider if tel.enabled else None
        )
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as http:
            if tel.enabled:
                HTTPXClientInstrumentor().instrument_client(http, tracer_provider=tel.provider)
            bus = event_plane(settings, http)
            directory = bus.directory
            chosen = router or DirectoryRouter(
                directory,
                replicas,
                policy=settings.routing_policy,
                block_size=settings.block_size,
                nats_up=lambda: bus.connected,
            )
            app.state.gateway = GatewayState(
                settings=settings,
                sessions=make_sessionmaker(engine),
                renderer=build_renderer(settings.model_dir),
                router=chosen,
                tracer=tel.tracer,
            )
            app.state.gateway.served_models = lambda: {
                st.model for st in directory.replicas.values() if st.view.live and st.model
            }
            app.state.directory = directory
            app.state.bus = bus
            metrics = app.state.gateway.metrics
            metrics.watch_plane(
                lambda: {
                    "lag_s": bus.lag_s,
                    "resyncs": directory.resyncs,
                    "heartbeat_misses": directory.heartbeat_misses,
                    "health_downs": directory.health_downs,
                    "rejections": dict(directory.rejections),
                    "live": sum(v.live for v in directory.views()),
                }
            )
            bus.tracer = tel.tracer
            await bus.start()
            scrape = None
            try:
                if settings.metrics_port is not None:
                    scrape = listen(metrics.registry, settings.host, settings.metrics_port)
                    app.state.metrics_url = scrape.url
                yield
            finally:
                if scrape is not None:
                    scrape.close()
                await bus.stop()
                # NOTE: a router handed in (tests, embedders) is the app's from then on:
                # its connections close with the app, on the loop that opened them.
                await chosen.aclose()
                app.state.gateway.intake.shutdown()
                engine.dispose()
                if telemetry is None:
                    tel.shutdown()

    # NOTE: /docs, /redoc and /openapi.json only when asked for (api_docs): a public
    # listener should not describe every route, admin ones included, to anyone.
    docs = settings.api_docs
    app = FastAPI(
        title="Cachepoint gateway",
        version="0.1.0",
        description="Anthropic-compatible Messages API with managed prompt caching.",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    errors.install(app)
    openapi.install(app)
    for module in (messages, openai, models, reports, admin, health):
        app.include_router(module.router)
    app.add_middleware(
        RequestIdMiddleware,
        max_body_bytes=settings.max_body_bytes,
        body_read_timeout_s=settings.body_read_timeout_s,
    )
    app.state.metrics_url = None  # the private /metrics listener's URL, while it runs
    instrument_server(app, tel)
    return app
