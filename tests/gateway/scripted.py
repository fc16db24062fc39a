"""A scripted replica and a real gateway in front of it, for tests on exact outputs.

The replica is a small app that speaks the replica API with chosen token texts, a
chosen pace, or a forged usage report, and records how many token events it actually
wrote per request. The gateway runs for real (uvicorn, SQLite or PostgreSQL ledger).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy import text

from cachepoint.gateway.app import create_app
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.fleet.routing import Routed
from cachepoint.gateway.fleet.upstream import ReplicaClient, ReplicaSession
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.tenants import create_key, create_org

MODEL = "cachepoint-tiny"

# ------------------------------------------------------------------ scripted replica


@dataclass
class Script:
    """How the scripted replica answers, and what it saw."""

    texts: list[str] = field(default_factory=lambda: ["ab"])  # token texts, cycled
    once: bool = False  # replay ``texts`` once (up to max_tokens) instead of cycling them
    stop_reason: str = "max_tokens"  # the final response's stop reason
    stop_sequence: str | None = None  # the final response's stop string (stop_sequence)
    delay_s: float = 0.0  # before each token event
    cache: dict[str, Any] = field(default_factory=dict)  # forged cache report fields
    extra_tokens: int = 0  # token events beyond max_tokens (a forged count)
    final_delta: int = 0  # added to the final output_tokens (a forged count)
    prefill_s: float = 0.0  # queue + prefill before prefill_done (dropped on a hang-up)
    dropped: set[str] = field(default_factory=set)  # request ids dropped before prefill_done
    calls: int = 0  # generate calls
    bodies: list[dict[str, Any]] = field(default_factory=list)  # generate bodies received
    sent: dict[str, int] = field(default_factory=dict)  # request id -> token events written
    finished: set[str] = field(default_factory=set)  # request ids streamed to the end


def scripted_replica(script: Script) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/generate")
    async def generate(request: Request) -> Any:
        body = await request.json()
        script.calls += 1
        script.bodies.append(body)
        rid = body["request_id"]
        n = body["max_tokens"] + script.extra_tokens
        if script.once:
            n = min(n, len(script.texts))
        prompt = len(body["token_ids"])
        cache = {
            "prompt_tokens": prompt,
            "engine_hit_tokens": 0,
            "computed_tokens": prompt,
            "entry_hit_tokens": 0,
            "entry_hit_lookback": None,
            "written_5m_tokens": 0,
            "written_1h_tokens": 0,
            "retention_refused": False,
            "refusal_reason": None,
            **script.cache,
        }
        # NOTE: like the replica, it polls for a hang-up while the request is queued or
        # prefilling, and drops it: no prefill_done, nothing committed.
        end = time.monotonic() + script.prefill_s
        while time.monotonic() < end:
            if await request.is_disconnected():
                script.dropped.add(rid)
                return Response(status_code=499)
            await asyncio.sleep(0.05)
        texts = [script.texts[i % len(script.texts)] for i in range(n)]
        result = {
            "request_id": rid,
            "replica": "fake",
            "epoch": 1,
            "model": MODEL,
            "output_token_ids": list(range(n)),
            "text": "".join(texts),
            "stop_reason": script.stop_reason,
            "stop_sequence": script.stop_sequence,
            "output_tokens": n + script.final_delta,
            "cache": cache,
            "timings": {"queue_s": 0.0, "prefill_s": 0.0, "decode_s": 0.0, "ttft_s": 0.0},
        }
        if not body.get("stream"):  # the replica's plain answer: after the whole generation
            await asyncio.sleep(script.delay_s * n)
            script.sent[rid] = n
            script.finished.add(rid)
            return result

        def line(obj: object) -> bytes:
            # NOTE: raw UTF-8, as the real replica writes it (pydantic leaves U+2028
            # and U+0085 unescaped), not json.dumps's ASCII escapes.
            return (json.dumps(obj, ensure_ascii=False) + "\n").encode()

        async def lines() -> Any:
            script.sent[rid] = 0
            yield line({"type": "prefill_done", "cache": cache})
            for i, t in enumerate(texts):
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                yield line({"type": "token", "token_id": i, "text": t})
                script.sent[rid] += 1  # resumed: the server took the line
            yield line({"type": "done", "response": result})
            script.finished.add(rid)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return app


class StaticRouter:
    """Every request to one replica; remembers the replicas reported as failed."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: ReplicaClient | None = None
        self.failures: list[str] = []

    def pick(self, req: Any) -> Routed:
        if self.client is None:  # NOTE: made lazily, on the gateway's own event loop
            self.client = ReplicaClient("fake", self.url, ReplicaSession())
        return Routed(self.client, None)

    def report_failure(self, name: str) -> None:
        self.failures.append(name)

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.http.aclose()

    def freshness_s(self, name: str) -> float | None:
        return None

    def started_s(self, name: str) -> float | None:
        return None

    def evicted_from(self, name: str, req: object, token: int) -> str | None:
        return None


@dataclass
class Gateway:
    url: str  # base URL
    db: str  # ledger URL
    keys: dict[str, str]  # "a", "b": API keys of two orgs
    router: StaticRouter

    def client(self, who: str = "a", **kw: Any) -> anthropic.Anthropic:
        kw.setdefault("max_retries", 0)
        return anthropic.Anthropic(base_url=self.url, api_key=self.keys[who], **kw)

    def rows(self) -> list[Any]:
        engine = make_engine(self.db)
        try:
            with engine.connect() as conn:
                q = "SELECT request_id, output_tokens, input_tokens FROM usage"
                return list(conn.execute(text(q)))
        finally:
            engine.dispose()

    def wait_rows(self, n: int, timeout: float = 10.0) -> list[Any]:
        deadline = time.time() + timeout
        while len(rows := self.rows()) < n and time.time() < deadline:
            time.sleep(0.05)
        return rows


def seed(db: str) -> dict[str, str]:
    engine = make_engine(db)
    upgrade(engine)
    keys = {}
    with make_sessionmaker(engine)() as s:
        for name in ("a", "b"):
            keys[name] = create_key(s, create_org(s, name))[1]
        s.commit()
    engine.dispose()
    return keys


def gateway_factory(serve: Callable[..., str], tmp_path: Path) -> Callable[..., Gateway]:
    """``make(script, db=None, **gateway settings)``: a gateway over a scripted replica
    (``serve`` is the conftest fixture that runs apps on uvicorn)."""

    def make(script: Script, db: str | None = None, **settings: Any) -> Gateway:
        db = db or f"sqlite:///{tmp_path}/gw-{uuid.uuid4().hex[:6]}.db"
        keys = seed(db)
        router = StaticRouter(serve(scripted_replica(script)))
        gw_settings = GatewaySettings(database_url=db, **settings)
        url = serve(create_app(gw_settings, router=router))
        return Gateway(url, db, keys, router)

    return make
