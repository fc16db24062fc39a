"""`cachepoint.runtime.serve`: what a served process does before uvicorn takes over."""

from __future__ import annotations

import gc
import os
import socket

import pytest
import uvicorn

import cachepoint.runtime.serve
from cachepoint.runtime.serve import serve


def test_serve_freezes_the_startup_heap(monkeypatch, free_port):
    seen = {}
    port = free_port()

    def fake_run(server: uvicorn.Server, sockets=None) -> None:
        seen["config"] = server.config
        seen["sockets"] = [s.getsockname() for s in sockets]
        seen["frozen"] = gc.get_freeze_count()
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    # NOTE: the real one replaces the root logger's handlers, pytest's included.
    monkeypatch.setattr(
        cachepoint.runtime.serve, "configure_logging", lambda *a: seen.setdefault("log", a)
    )
    marker = object()
    try:
        assert serve(lambda: marker, "127.0.0.1", port, "warning") == 0
    finally:
        gc.unfreeze()  # the rest of the test session must not inherit it
    config = seen["config"]
    assert config.app is marker
    assert seen["frozen"] > 0
    assert (config.host, config.port, config.log_level) == ("127.0.0.1", port, "warning")
    # uvicorn is handed the socket serve() bound, not left to bind its own.
    assert seen["sockets"] == [("127.0.0.1", port)]
    assert seen["log"] == ("warning", "text")


def test_serve_returns_the_code_the_app_asked_to_exit_with(monkeypatch, free_port):
    class App:
        class state:  # stands in for FastAPI's app.state
            pass

    def fake_run(server: uvicorn.Server, sockets=None) -> None:
        server.started = True
        App.state.request_exit(70)  # what the replica's watchdog calls on loop death
        assert server.should_exit

    timers = []

    class FakeTimer:
        def __init__(self, interval, function, args):
            timers.append((interval, function, args))
            self.daemon = False

        def start(self) -> None:
            timers.append("started")

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    monkeypatch.setattr(cachepoint.runtime.serve.threading, "Timer", FakeTimer)
    monkeypatch.setattr(cachepoint.runtime.serve, "configure_logging", lambda *a: None)
    try:
        assert serve(App, "127.0.0.1", free_port(), "warning", exit_grace_s=7) == 70
    finally:
        gc.unfreeze()
    # A shutdown that hangs still ends the process, with the same code.
    assert timers == [(7, os._exit, (70,)), "started"]


class _NoTimer:
    def __init__(self, *args: object) -> None:
        self.daemon = False

    def start(self) -> None:
        pass


def test_listening_is_set_once_the_port_accepts_not_during_the_lifespan(monkeypatch, free_port):
    """What announces the app (the replica's heartbeat) waits on ``state.listening``:
    uvicorn binds only after the lifespan startup, so a caller sent there from the
    startup was refused (a rolling update's request got a 529 in CI)."""
    import asyncio
    import contextlib
    import threading
    from collections.abc import AsyncIterator

    from fastapi import FastAPI

    port = free_port()
    seen: dict[str, object] = {}

    async def connect() -> str:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError as exc:
            return f"refused ({type(exc).__name__})"
        writer.close()
        return "accepted"

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        listening = app.state.listening
        seen["set_in_startup"] = listening.is_set()
        seen["connect_in_startup"] = await connect()

        async def announce() -> None:
            await listening.wait()
            seen["connect_when_set"] = await connect()
            app.state.request_exit(0)

        task = asyncio.create_task(announce())
        yield
        task.cancel()

    monkeypatch.setattr(cachepoint.runtime.serve, "configure_logging", lambda *a: None)
    # NOTE: request_exit arms an os._exit for a shutdown that hangs: it would end pytest.
    monkeypatch.setattr(cachepoint.runtime.serve.threading, "Timer", _NoTimer)
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(
            serve(lambda: FastAPI(lifespan=lifespan), "127.0.0.1", port, "warning")
        ),
        daemon=True,
    )
    try:
        thread.start()
        thread.join(30)
    finally:
        gc.unfreeze()
    assert result == [0], seen
    assert seen == {
        "set_in_startup": False,
        "connect_in_startup": "refused (ConnectionRefusedError)",
        "connect_when_set": "accepted",
    }


def test_the_port_is_held_while_the_app_is_built(monkeypatch, free_port):
    """`cachepoint up` picks a free port for each replica; a vLLM replica takes 30 s or
    more to build its app, and uvicorn alone binds only after that: the port was taken
    meanwhile (vLLM opens ephemeral sockets of its own) and the replica exited 3 with
    "address already in use" (seen in a clean-clone `.ci/run`). serve() binds first."""

    def taken(port: int) -> bool:
        # NOTE: a plain bind, as another process's would be; a port given out for an
        # ephemeral bind (port 0) or connect is never one that is bound.
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return True
        return False

    port = free_port()
    seen = {}

    def factory() -> object:
        seen["held_while_building"] = taken(port)
        return object()

    def fake_run(server: uvicorn.Server, sockets=None) -> None:
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    monkeypatch.setattr(cachepoint.runtime.serve, "configure_logging", lambda *a: None)
    try:
        assert serve(factory, "127.0.0.1", port, "warning") == 0
    finally:
        gc.unfreeze()
    assert seen == {"held_while_building": True}
    assert not taken(port)  # and released once served


def test_a_port_in_use_is_one_clear_line_and_exit_3(monkeypatch, free_port, capsys):
    port = free_port()
    built = []
    monkeypatch.setattr(cachepoint.runtime.serve, "configure_logging", lambda *a: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        assert serve(lambda: built.append(1), "127.0.0.1", port, "warning") == 3
    # Nothing was built: a replica does not load its model for a port it cannot serve.
    assert built == []
    err = capsys.readouterr().err
    assert err.startswith(f"cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in err and "Traceback" not in err


def test_an_app_that_cannot_be_built_frees_the_port(monkeypatch, free_port):
    port = free_port()
    monkeypatch.setattr(cachepoint.runtime.serve, "configure_logging", lambda *a: None)

    def factory() -> object:
        raise RuntimeError("no model")

    with pytest.raises(RuntimeError, match="no model"):
        serve(factory, "127.0.0.1", port, "warning")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free again: no EADDRINUSE
