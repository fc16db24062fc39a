"""Client idempotency keys on POST /v1/messages (the `idempotency-key` header).

The same key (scoped to the API key) with the same request within 24 h gets the first
request's outcome again, byte for byte, without generating or billing again. The same
key with a different request is a 400. A duplicate that arrives while the first is
still in flight waits for it (polling the database, so this holds across gateway
replicas too) and then gets its outcome; only if the first has not finished within
the upstream timeout does it get a 409. A first request that fails, or a stream cut
before its full charge is written, releases the key so that a retry runs afresh; a
stream cut after it keeps the key, with the whole stream recorded for the retry.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from fastapi import Request
from fastapi.responses import Response
from sqlalchemy import ColumnElement, Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from .db.models import IdempotencyRecord
from .errors import ApiError, invalid
from .schemas.messages import MessagesRequest
from .tenants import KeyContext

HEADER = "idempotency-key"
REPLAYED_HEADER = "idempotent-replayed"  # Stripe's name: "true" on a replayed answer
ORIGINAL_ID_HEADER = "cachepoint-original-request-id"  # the request that generated it
TTL_S = 24 * 3600  # how long a key's outcome is kept and replayed
POLL_S = 0.1  # a waiting duplicate's first look again at the first request's row
POLL_MAX_S = 1.0  # its longest pause: a long generation costs ~1 query a second
PURGE_EVERY_S = 60.0  # lazy purge of expired keys, at most this often per process
MAX_KEY_CHARS = 255
# NOTE: a key still "in flight" after this long belongs to a gateway that died; it is
# given up so the key is not blocked for 24 h. Fixed, not the upstream timeout: that
# bounds each read from a replica, not a whole generation.
ABANDONED_S = 3600

_T = IdempotencyRecord  # short alias for the statements below
_last_purge = [0.0]  # monotonic time of this process's last purge


def key_from(request: Request) -> str | None:
    """The header's value, checked: 1-255 visible ASCII characters."""
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    if not 0 < len(raw) <= MAX_KEY_CHARS or not all(33 <= ord(c) <= 126 for c in raw):
        raise invalid(f"{HEADER} must be 1-{MAX_KEY_CHARS} visible ASCII characters")
    return raw


def fingerprint(body: MessagesRequest, betas: set[str]) -> str:
    """sha256 of the request as parsed (key order and whitespace do not matter), with
    the betas, which change what the request means."""
    canon = {"body": body.model_dump(mode="json"), "betas": sorted(betas)}
    raw = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True, slots=True)
class Recorded:
    """The first request's outcome, as it is replayed."""

    status: int  # HTTP status
    kind: str  # json | sse
    headers: dict[str, str]  # headers to repeat (scope, replica)
    body: bytes  # the exact response body (the whole SSE stream for kind sse)
    request_id: str  # the request that generated it

    def response(self) -> Response:
        media = "text/event-stream" if self.kind == "sse" else "application/json"
        headers = {**self.headers, REPLAYED_HEADER: "true", ORIGINAL_ID_HEADER: self.request_id}
        return Response(self.body, self.status, headers=headers, media_type=media)


@dataclass(frozen=True, slots=True)
class Claim:
    """This request holds the key: it must `complete` it or `release` it."""

    engine: Engine  # the ledger's database
    api_key_id: str  # scope of the key
    key: str  # the client's idempotency key
    request_id: str  # this request: only the holder may complete or release

    def _mine(self) -> list[ColumnElement[bool]]:
        return [
            _T.api_key_id == self.api_key_id,
            _T.key == self.key,
            _T.request_id == self.request_id,
        ]

    def _complete(self, status: int, headers: dict[str, str], body: bytes, kind: str) -> None:
        stmt = update(_T).where(*self._mine())
        values = {"status": status, "headers": json.dumps(headers), "response": body}
        with self.engine.begin() as conn:
            conn.execute(stmt.values(**values, kind=kind))

    def _release(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(delete(_T).where(*self._mine()))

    async def complete(self, status: int, headers: dict[str, str], body: bytes, kind: str) -> None:
        await run_in_threadpool(self._complete, status, headers, body, kind)

    async def release(self) -> None:
        await run_in_threadpool(self._release)


class _InFlight:
    """Another request holds the key and has not finished."""


def _try(
    engine: Engine, ctx: KeyContext, key: str, digest: str, rid: str
) -> Claim | Recorded | _InFlight:
    now = datetime.now(UTC)
    now_s = int(now.timestamp())
    row = {
        "api_key_id": ctx.key_id,
        "key": key,
        "org_id": ctx.org_id,
        "body_sha256": digest,
        "request_id": rid,
        "status": None,
        "kind": "json",
        "headers": "{}",
        "response": None,
        "created_at": now,
        "created_s": now_s,
    }
    try:
        with engine.begin() as conn:
            conn.execute(insert(_T), [row])
        _purge(engine, now_s)
        return Claim(engine, ctx.key_id, key, rid)
    except IntegrityError:
        pass
    where = [_T.api_key_id == ctx.key_id, _T.key == key]
    with engine.begin() as conn:
        found = conn.execute(select(_T.__table__).where(*where)).mappings().first()
        if found is None:
            return _InFlight()  # released between our insert and select: try again
        expired = found["created_s"] < now_s - TTL_S
        abandoned = found["status"] is None and found["created_s"] < now_s - ABANDONED_S
        if expired or abandoned:
            conn.execute(delete(_T).where(*where, _T.request_id == found["request_id"]))
            return _InFlight()  # then claim it on the next try
    if found["body_sha256"] != digest:
        raise invalid(
            f"{HEADER} {key!r} was already used with a different request body; "
            "a retry must send the same request, a new request needs a new key"
        )
    if found["status"] is None:
        return _InFlight()
    return Recorded(
        int(found["status"]),
        str(found["kind"]),
        json.loads(found["headers"]),
        bytes(found["response"] or b""),
        str(found["request_id"]),
    )


def _purge(engine: Engine, now_s: int) -> None:
    mono = time.monotonic()
    if mono - _last_purge[0] < PURGE_EVERY_S:
        return
    _last_purge[0] = mono
    with engine.begin() as conn:
        conn.execute(delete(_T).where(_T.created_s < now_s - TTL_S))


async def begin(
    engine: Engine,
    ctx: KeyContext,
    key: str,
    digest: str,
    rid: str,
    wait_s: float,
    client_gone: Callable[[], Awaitable[bool]] | None = None,
) -> Claim | Recorded:
    """Claim ``key`` for this request, or get the first request's outcome (waiting up
    to ``wait_s`` for one in flight)."""
    deadline = time.monotonic() + wait_s
    pause = POLL_S
    while True:
        got = await run_in_threadpool(_try, engine, ctx, key, digest, rid)
        if not isinstance(got, _InFlight):
            return got
        if time.monotonic() > deadline:
            raise ApiError(
                409,
                "invalid_request_error",
                f"a request with {HEADER} {key!r} is still in progress; retry later",
            )
        if client_gone is not None and await client_gone():
            raise ApiError(499, "invalid_request_error", "client disconnected")
        await asyncio.sleep(pause)
        pause = min(pause * 2, POLL_MAX_S)
