"""Client idempotency keys on POST /v1/messages (the `idempotency-key` header).

The same key (scoped to the API key) with the same request within 24 h gets the first
request's outcome again, byte for byte, without generating or billing again. The same
key with a different request is a 400. A duplicate that arrives while the first is
still in flight waits for it (polling the database, so this holds across gateway
replicas too) and then gets its outcome; only if the first has not finished within
the upstream timeout does it get a 409. A first request that fails, or a stream cut
before its full charge is written, releases the key so that a retry runs afresh; a
stream cut after it keeps the key, with the whole stream recorded for the retry.

A key in flight is held by a lease (``lease_until_s``) that its gateway renews every
third of the lease while it works. A gateway that dies stops renewing: once the lease
has lapsed, a waiting retry takes the key over (one atomic UPDATE on the old owner's
request id, so of several gateways racing for it exactly one wins), bills the cut
attempt from the charge its stream recorded on the row (``progress``, written at most
once a second: at most what was delivered), and runs the call afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from sqlalchemy import ColumnElement, Engine, and_, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from starlette.concurrency import run_in_threadpool

from cachepoint.gateway.billing.ledger import Charge, charge_from_json, charge_to_json
from cachepoint.gateway.db.models import IdempotencyRecord
from cachepoint.gateway.errors import ApiError, invalid
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.gateway.tenancy.tenants import KeyContext

HEADER = "idempotency-key"
REPLAYED_HEADER = "idempotent-replayed"  # Stripe's name: "true" on a replayed answer
ORIGINAL_ID_HEADER = "cachepoint-original-request-id"  # the request that generated it
TTL_S = 24 * 3600  # how long a key's outcome is kept and replayed
POLL_S = 0.1  # a waiting duplicate's first look again at the first request's row
POLL_MAX_S = 1.0  # its longest pause: a long generation costs ~1 query a second
PURGE_EVERY_S = 60.0  # lazy purge of expired keys, at most this often per process
MAX_KEY_CHARS = 255
LEASE_S = 15.0  # default lease of a key in flight (the `idempotency_lease_s` setting)
# NOTE: how often a keyed stream's charge so far is written to its row: what a crash can
# leave unbilled is what was delivered since (plus one write's latency).
PROGRESS_EVERY_S = 1.0
# NOTE: a row in flight without a lease was written by a gateway that does not renew
# one (before migration 0005, during a rolling upgrade): it lapses after the hour such
# a gateway gave it, since a generation may legitimately run that long.
LEGACY_LEASE_S = 3600

log = logging.getLogger(__name__)

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


def digest_of(api: str, body: BaseModel) -> str:
    """`fingerprint` for another API's request (OpenAI's): sha256 of it as parsed, with
    the API's name, so one key reused across APIs is a different request."""
    canon = {"api": api, "body": body.model_dump(mode="json")}
    raw = json.dumps(canon, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()


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


def _lease_until(now: float, lease_s: float) -> int:
    """Epoch seconds a lease taken or renewed at ``now`` holds to (rounded up)."""
    return math.ceil(now + lease_s)


def _lapsed(now_s: int) -> ColumnElement[bool]:
    """The row's lease lapsed before ``now_s`` (legacy rows: an hour after creation)."""
    legacy = and_(_T.lease_until_s.is_(None), _T.created_s < now_s - LEGACY_LEASE_S)
    return or_(_T.lease_until_s < now_s, legacy)


@dataclass(slots=True)
class _Lease:
    """What the keeper task of one claim needs: never the Claim itself, so that a claim
    dropped without `complete` or `release` is collected and its lease lapses."""

    engine: Engine  # the ledger's database
    where: list[ColumnElement[bool]]  # the claim's row, while this request owns it
    request_id: str  # the owner, for log lines
    lease_s: float  # how long each renewal holds
    source: Callable[[], Charge] | None = None  # the stream's charge so far, once tracked
    written: str | None = None  # the progress last written (JSON)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # write now: tracking began
    stopped: bool = False  # complete or release has begun: write nothing more

    def renew(self, progress: str | None) -> bool:
        """Extend the lease (and write the progress); False when the row is no longer
        this request's (taken over after a lapse, or already finished)."""
        values: dict[str, object] = {"lease_until_s": _lease_until(time.time(), self.lease_s)}
        if progress is not None:
            values["progress"] = progress
        stmt = update(_T).where(*self.where, _T.status.is_(None)).values(**values)
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    def progress(self) -> str | None:
        """The stream's charge so far as JSON, when it changed since the last write."""
        if self.source is None:
            return None
        now = charge_to_json(self.source())
        return None if now == self.written else now


async def _keep(lease: _Lease) -> None:
    """Renew the lease every third of it, and write the stream's progress at most once
    per PROGRESS_EVERY_S, until cancelled (by `Claim._stop`, or when the claim is
    collected unfinished)."""
    renew_every = lease.lease_s / 3
    last_renew = time.monotonic()
    while not lease.stopped:
        tick = min(renew_every, PROGRESS_EVERY_S) if lease.source is not None else renew_every
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(lease.wake.wait(), tick)
        lease.wake.clear()
        try:
            progress = lease.progress()
        except Exception as exc:  # a report that cannot be billed: the stream says so
            log.warning("request %s: progress not recorded: %r", lease.request_id, exc)
            lease.source, progress = None, None
        if progress is None and time.monotonic() - last_renew < renew_every:
            continue
        try:
            mine = await run_in_threadpool(lease.renew, progress)
        except Exception as exc:  # the database is down: try again on the next tick
            log.warning("request %s: idempotency lease not renewed: %r", lease.request_id, exc)
            continue
        last_renew = time.monotonic()
        if not mine:
            if not lease.stopped:
                log.warning(
                    "request %s: lost its idempotency key (its lease lapsed and a retry "
                    "took it over)",
                    lease.request_id,
                )
            return
        if progress is not None:
            lease.written = progress


def _cancel_soon(loop: asyncio.AbstractEventLoop, task: asyncio.Task[None]) -> None:
    """The claim was collected unfinished: stop renewing (from whatever thread the
    collector ran in), so its lease lapses and a retry can take the key over."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: so is the task
        loop.call_soon_threadsafe(task.cancel)


@dataclass(slots=True, weakref_slot=True)
class Claim:
    """This request holds the key: it must `complete` it or `release` it."""

    engine: Engine  # the ledger's database
    api_key_id: str  # scope of the key
    key: str  # the client's idempotency key
    request_id: str  # this request: only the holder may complete or release
    lease_s: float = LEASE_S  # how long the lease holds after each renewal
    # The attempt whose lapsed lease this claim took over, as its stream recorded it
    # (billed already, under that attempt's request id); None if none or nothing recorded.
    cut: Charge | None = None
    _lease: _Lease | None = None  # the keeper's state, once `hold` started it
    _keeper: asyncio.Task[None] | None = None  # renews the lease until complete/release

    def _mine(self) -> list[ColumnElement[bool]]:
        return [
            _T.api_key_id == self.api_key_id,
            _T.key == self.key,
            _T.request_id == self.request_id,
        ]

    def hold(self) -> None:
        """Start renewing the lease (on the running event loop)."""
        self._lease = _Lease(self.engine, self._mine(), self.request_id, self.lease_s)
        self._keeper = asyncio.get_running_loop().create_task(_keep(self._lease))
        weakref.finalize(self, _cancel_soon, asyncio.get_running_loop(), self._keeper)

    def track(self, source: Callable[[], Charge]) -> None:
        """Record ``source()`` (a stream's charge so far) on the row now and then at
        most once per PROGRESS_EVERY_S, for the retry that takes over if this gateway
        dies. ``source`` must only ever bill what was delivered."""
        if self._lease is not None:
            self._lease.source = source
            self._lease.wake.set()

    async def _stop(self) -> None:
        if self._lease is not None:
            self._lease.stopped = True
        if self._keeper is not None:
            self._keeper.cancel()
            # NOTE: waits for a renewal already running in a worker thread, so that it
            # cannot land after the row is completed or deleted.
            # (asyncio.wait: the keeper's own cancellation is not this caller's.)
            await asyncio.wait({self._keeper})

    def _complete(self, status: int, headers: dict[str, str], body: bytes, kind: str) -> None:
        stmt = update(_T).where(*self._mine())
        values = {"status": status, "headers": json.dumps(headers), "response": body}
        with self.engine.begin() as conn:
            conn.execute(stmt.values(**values, kind=kind, progress=None))

    def _release(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(delete(_T).where(*self._mine()))

    async def complete(self, status: int, headers: dict[str, str], body: bytes, kind: str) -> None:
        await self._stop()
        await run_in_threadpool(self._complete, status, headers, body, kind)

    async def release(self) -> None:
        await self._stop()
        await run_in_threadpool(self._release)


class _InFlight:
    """Another request holds the key and has not finished."""


BillCut = Callable[[Charge], object]  # bills a cut attempt's charge (state.bill)


def _try(
    engine: Engine,
    ctx: KeyContext,
    key: str,
    digest: str,
    rid: str,
    lease_s: float = LEASE_S,
    bill_cut: BillCut | None = None,
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
        "lease_until_s": _lease_until(now.timestamp(), lease_s),
        "progress": None,
    }
    try:
        with engine.begin() as conn:
            conn.execute(insert(_T), [row])
        _purge(engine, now_s)
        return Claim(engine, ctx.key_id, key, rid, lease_s)
    except IntegrityError:
        pass
    where = [_T.api_key_id == ctx.key_id, _T.key == key]
    with engine.begin() as conn:
        found = conn.execute(select(_T.__table__).where(*where)).mappings().first()
        if found is None:
            return _InFlight()  # released between our insert and select: try again
        if found["created_s"] < now_s - TTL_S:
            conn.execute(delete(_T).where(*where, _T.request_id == found["request_id"]))
            return _InFlight()  # then claim it on the next try
    if found["body_sha256"] != digest:
        raise invalid(
            f"{HEADER} {key!r} was already used with a different request body; "
            "a retry must send the same request, a new request needs a new key"
        )
    if found["status"] is None:
        lease = found["lease_until_s"]
        lapsed = lease < now_s if lease is not None else found["created_s"] < now_s - LEGACY_LEASE_S
        if lapsed:
            return _take_over(engine, ctx, key, rid, found, now, lease_s, bill_cut)
        return _InFlight()
    return Recorded(
        int(found["status"]),
        str(found["kind"]),
        json.loads(found["headers"]),
        bytes(found["response"] or b""),
        str(found["request_id"]),
    )


def _take_over(
    engine: Engine,
    ctx: KeyContext,
    key: str,
    rid: str,
    found: Any,
    now: datetime,
    lease_s: float,
    bill_cut: BillCut | None,
) -> Claim | _InFlight:
    """Claim a key whose owner's lease lapsed (its gateway died), after billing what
    the owner's stream recorded it had delivered."""
    old = str(found["request_id"])
    cut = _recorded_charge(old, found["progress"])
    if cut is not None and bill_cut is not None:
        # NOTE: before the takeover, and idempotent by the old request id: a taker that
        # loses the race below, or dies right after, bills nothing twice, and one that
        # dies before leaves the progress for the next. If the old gateway billed its
        # final charge before it died, this is a no-op too.
        bill_cut(cut)
    now_s = int(now.timestamp())
    mine = [_T.api_key_id == ctx.key_id, _T.key == key, _T.request_id == old]
    values = {
        "request_id": rid,
        "lease_until_s": _lease_until(now.timestamp(), lease_s),
        "progress": None,
        "created_at": now,
        "created_s": now_s,
    }
    # NOTE: the WHERE repeats what made it lapsed, and the row is matched by the old
    # owner: of two gateways racing (PostgreSQL re-checks the WHERE on the row the
    # winner committed; SQLite has one writer), exactly one updates it.
    stmt = update(_T).where(*mine, _T.status.is_(None), _lapsed(now_s)).values(**values)
    with engine.begin() as conn:
        if conn.execute(stmt).rowcount != 1:
            return _InFlight()  # another retry won: wait for its outcome
    log.warning(
        "request %s: took over %s from %s, whose lease lapsed (its gateway died?); "
        "the cut attempt billed %s",
        rid,
        HEADER,
        old,
        "nothing" if cut is None else f"{cut.buckets.output_tokens} output tokens",
    )
    return Claim(engine, ctx.key_id, key, rid, lease_s, cut)


def _recorded_charge(old: str, raw: str | None) -> Charge | None:
    """The cut attempt's charge from its row, if it recorded one that belongs to it."""
    if raw is None:
        return None
    try:
        charge = charge_from_json(raw)
    except ValueError as exc:
        log.warning("request %s: its recorded progress is unreadable: %s", old, exc)
        return None
    return charge if charge.request_id == old else None


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
    *,
    lease_s: float = LEASE_S,
    bill_cut: BillCut | None = None,
) -> Claim | Recorded:
    """Claim ``key`` for this request, or get the first request's outcome (waiting up
    to ``wait_s`` for one in flight). A claim whose lease lapsed is taken over, and the
    attempt it cut is billed with ``bill_cut`` (sync: it runs in a worker thread)."""
    deadline = time.monotonic() + wait_s
    pause = POLL_S
    while True:
        got = await run_in_threadpool(_try, engine, ctx, key, digest, rid, lease_s, bill_cut)
        if isinstance(got, Claim):
            got.hold()
            return got
        if isinstance(got, Recorded):
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
