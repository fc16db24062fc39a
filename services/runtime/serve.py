"""What every service command does after parsing its flags: settings, logging, uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any, Literal, TypeVar

from pydantic import AliasChoices, ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def shared_env(field: str, service: str) -> AliasChoices:
    """Read ``field`` from its own name, CACHEPOINT_<SERVICE>_<FIELD>, or the fleet-wide
    CACHEPOINT_<FIELD> that the gateway and the replicas share (NATS URL, credentials,
    the internal token): one env var configures a whole pod or embedded stack."""
    # NOTE: not the bare field name: pydantic-settings would read it from the
    # environment too (NATS_USER, say, which the nats CLI uses) and let it win.
    # Keyword arguments still work by field name (populate_by_name).
    env = field.upper()
    return AliasChoices(f"CACHEPOINT_{service}_{env}", f"CACHEPOINT_{env}")


def settings_from_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cls: type[S]
) -> S:
    """Flags that were given override the environment; a bad value is a usage error
    naming the setting, never a traceback."""
    local = ("log_level", "log_format")
    given = {k: v for k, v in vars(args).items() if v is not None and k not in local}
    try:
        return cls(**given)
    except ValidationError as exc:
        parser.error("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))


LogFormat = Literal["json", "text"]
_TEXT = "%(asctime)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the record's ``fields`` (pass
    ``extra={"fields": {...}}``) merged in, and a traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """The plain format, with a record's ``fields`` appended as JSON."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = getattr(record, "fields", None)
        return f"{line} {json.dumps(fields, default=str)}" if isinstance(fields, dict) else line


def configure_logging(log_level: str, log_format: LogFormat = "text") -> None:
    """Root logger to stderr in the chosen format (replaces any handler already there)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(log_level.upper())


def _draining_server(config: Any, state: Any, cut_after_s: float) -> Any:
    """A uvicorn server that, on the first SIGTERM, awaits ``state.drain()`` while it
    keeps serving, then shuts down; whatever still runs is cut ``cut_after_s`` later."""
    import uvicorn

    log = logging.getLogger(__name__)

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        draining = False
        drain_task: asyncio.Future[None] | None = None

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            listening = getattr(state, "listening", None)
            if self.started and isinstance(listening, asyncio.Event):
                # NOTE: uvicorn binds its sockets only after the app's lifespan startup;
                # an app that announced itself from there (the replica's heartbeat) would
                # send callers to a port that still refuses connections.
                listening.set()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            drain = getattr(state, "drain", None)
            first = not (self.draining or self.should_exit)
            if sig != signal.SIGTERM or drain is None or not first or self.loop is None:
                # NOTE: SIGINT, a second SIGTERM, or an app that does not drain (or has
                # not started yet): as uvicorn does, a graceful stop now.
                super().handle_exit(sig, frame)
                return
            self.draining = True
            # NOTE: a signal handler runs between two bytecodes of the loop's own
            # thread; the drain is handed to the loop, which keeps serving meanwhile.
            self.loop.call_soon_threadsafe(self._start_drain, drain)

        def _start_drain(self, drain: Callable[[], Awaitable[object]]) -> None:
            self.drain_task = asyncio.ensure_future(self._drain_then_exit(drain))

        async def _drain_then_exit(self, drain: Callable[[], Awaitable[object]]) -> None:
            try:
                await drain()
            except Exception:
                log.exception("drain failed; shutting down anyway")
            # NOTE: the drain's grace is over: what still runs is cut shortly after,
            # where uvicorn alone would wait for every connection without end.
            self.config.timeout_graceful_shutdown = cut_after_s
            self.should_exit = True

    return DrainingServer(config)


class StartupError(Exception):
    """The app cannot start with these settings (a KV budget too small, a model the
    engine refuses): `serve` prints this message alone, no traceback, and exits 2."""


class _HideStartupTraceback(logging.Filter):
    """Drops uvicorn's traceback of a `StartupError` (its message is printed instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno >= logging.ERROR
            and record.getMessage().startswith("Traceback")
            and f"{StartupError.__module__}.{StartupError.__name__}" in record.getMessage()
        )


def serve(
    app_factory: Callable[[], Any],
    host: str,
    port: int,
    log_level: str,
    *,
    log_format: LogFormat = "text",
    exit_grace_s: float = 10.0,
) -> int:
    """Run the app with uvicorn, which turns SIGINT/SIGTERM into a graceful shutdown
    (the app's lifespan then drains what it owns). Returns the exit status.

    An app that puts ``drain`` (an async callable, no arguments) in its ``state`` is
    drained on the first SIGTERM: the server keeps answering while ``drain()`` runs
    (the replica refuses new work then, with a clear 503, and lets what runs finish),
    then shuts down and this returns 0. SIGINT, and a second SIGTERM, stop at once.

    ``state.listening`` is an `asyncio.Event` set once the server accepts connections
    (after the app's lifespan startup): what announces the app to others waits on it.

    The app may stop the server itself: ``serve`` puts ``request_exit(code)`` in its
    ``state``; the server then shuts down gracefully and this returns ``code``. If
    that takes over ``exit_grace_s`` the process ends with ``os._exit(code)``: a broken
    process must not stay up because one connection never closes.
    """
    import uvicorn

    configure_logging(log_level, log_format)
    # NOTE: the port is bound first, before the app is built: uvicorn alone binds only
    # after the lifespan startup (a vLLM replica's takes 30 s or more), and a port
    # chosen for this process (`cachepoint up`'s free_port) was taken meanwhile, by
    # vLLM's own ephemeral sockets among others: the replica then exited 3 ("address
    # already in use", seen in a clean-clone `.ci/run`). A bound port is never given
    # out by the kernel for another bind to port 0 or a connect. It is not listening
    # yet, so connections are refused (not queued for 30 s) until uvicorn listens.
    try:
        sock = _bind(host, port)
    except OSError as exc:
        print(f"cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 3
    try:
        app = app_factory()
    except BaseException:
        sock.close()  # an app that cannot be built (raised by a caller's factory) frees it
        raise
    # NOTE: in JSON, uvicorn's own lines go through the root handler too (log_config
    # None); in text it keeps its usual format.
    extra: dict[str, Any] = {"log_config": None} if log_format == "json" else {}
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, **extra)
    state = getattr(app, "state", None)
    server = _draining_server(config, state, exit_grace_s)
    exit_code = 0

    def request_exit(code: int) -> None:
        nonlocal exit_code
        exit_code = code
        server.should_exit = True
        timer = threading.Timer(exit_grace_s, os._exit, (code,))
        timer.daemon = True
        timer.start()

    if state is not None:
        state.request_exit = request_exit
        state.listening = asyncio.Event()
    hide = _HideStartupTraceback()
    logging.getLogger("uvicorn.error").addFilter(hide)
    # NOTE: what is alive now (the model, the schemas, the routes) lives as long as the
    # process. Frozen, the collector stops re-scanning it: on the replica a full
    # collection otherwise stalls a request for about 0.2 s every few dozen requests.
    gc.collect()
    gc.freeze()
    try:
        with contextlib.suppress(KeyboardInterrupt):  # as uvicorn.run does
            server.run(sockets=[sock])
    except SystemExit:
        # NOTE: uvicorn exits (3) itself when the app's startup fails; a StartupError's
        # message is the whole story, so it replaces uvicorn's exit.
        problem = getattr(state, "startup_error", None)
        if problem is None:
            raise
        print(f"{getattr(app, 'title', 'cachepoint')}: cannot start: {problem}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("uvicorn.error").removeFilter(hide)
        sock.close()
    if not server.started and exit_code == 0:
        sys.exit(3)  # as uvicorn.run does (its STARTUP_FAILURE): the app never came up
    return exit_code


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` as uvicorn binds one (SO_REUSEADDR; IPv6 for
    an address with a colon), not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    # NOTE: a process forked from here on (vLLM's engine core and workers) must not
    # hold the server's socket: its copy would keep the port taken after this process
    # dies, and a restart on the same port would fail.
    os.register_at_fork(after_in_child=sock.close)
    return sock
