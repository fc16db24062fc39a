"""`cachepoint.serve`: what a served process does before uvicorn takes over."""

from __future__ import annotations

import gc
import os

import uvicorn

import cachepoint.serve
from cachepoint.serve import serve


def test_serve_freezes_the_startup_heap(monkeypatch):
    seen = {}

    def fake_run(server: uvicorn.Server) -> None:
        seen["config"] = server.config
        seen["frozen"] = gc.get_freeze_count()
        server.started = True

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    # NOTE: the real one replaces the root logger's handlers, pytest's included.
    monkeypatch.setattr(cachepoint.serve, "configure_logging", lambda *a: seen.setdefault("log", a))
    marker = object()
    try:
        assert serve(lambda: marker, "127.0.0.1", 1234, "warning") == 0
    finally:
        gc.unfreeze()  # the rest of the test session must not inherit it
    config = seen["config"]
    assert config.app is marker
    assert seen["frozen"] > 0
    assert (config.host, config.port, config.log_level) == ("127.0.0.1", 1234, "warning")
    assert seen["log"] == ("warning", "text")


def test_serve_returns_the_code_the_app_asked_to_exit_with(monkeypatch):
    class App:
        class state:  # stands in for FastAPI's app.state
            pass

    def fake_run(server: uvicorn.Server) -> None:
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
    monkeypatch.setattr(cachepoint.serve.threading, "Timer", FakeTimer)
    monkeypatch.setattr(cachepoint.serve, "configure_logging", lambda *a: None)
    try:
        assert serve(App, "127.0.0.1", 1234, "warning", exit_grace_s=7) == 70
    finally:
        gc.unfreeze()
    # A shutdown that hangs still ends the process, with the same code.
    assert timers == [(7, os._exit, (70,)), "started"]
