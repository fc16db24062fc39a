"""`cachepoint.serve`: what a served process does before uvicorn takes over."""

from __future__ import annotations

import gc

import uvicorn

from cachepoint.serve import serve


def test_serve_freezes_the_startup_heap(monkeypatch):
    seen = {}

    def fake_run(app, **kwargs):
        seen["app"] = app
        seen["frozen"] = gc.get_freeze_count()
        seen["kwargs"] = kwargs

    monkeypatch.setattr(uvicorn, "run", fake_run)
    marker = object()
    try:
        serve(lambda: marker, "127.0.0.1", 1234, "warning")
    finally:
        gc.unfreeze()  # the rest of the test session must not inherit it
    assert seen["app"] is marker
    assert seen["frozen"] > 0
    assert seen["kwargs"] == {"host": "127.0.0.1", "port": 1234, "log_level": "warning"}
