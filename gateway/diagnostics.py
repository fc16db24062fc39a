"""Cache diagnostics on the request path: keep a request's prompt fingerprint, and
answer the `diagnostics` object by comparing it with the turn before.

The client's side is Anthropic's contract (docs/gateway.md, "Cache diagnostics"):
- a request that sends ``diagnostics`` (even ``{"previous_message_id": null}``) has its
  fingerprint kept under its response id, scoped to its org and workspace, and gets a
  ``diagnostics`` field; one that sends none gets no field;
- ``null``: a first turn, or nothing diverged (the prompt only appended);
- ``previous_message_not_found``: no fingerprint under that id for this org and
  workspace (never fingerprinted, expired, or another tenant's: the answer is the same,
  so it says nothing about other tenants);
- otherwise the first divergence (`cachepoint.gateway.contract.fingerprint.diagnose`).

Without the opt-in, a request that carries a session (Claude Code's session header, or
the session in ``metadata.user_id``) is fingerprinted too and compared with the turn of
its session it continues; the reason goes to the ledger row, the trace and a metric,
not to the response.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Connection, Engine, delete, insert, select
from sqlalchemy.exc import IntegrityError

from cachepoint.gateway.contract.fingerprint import (
    REASONS_WITH_TOKENS,
    SERVER_REASONS,
    Fingerprint,
    FingerprintError,
    diagnose,
    shared_blocks,
)
from cachepoint.gateway.db.models import PromptFingerprint, UsageRecord

log = logging.getLogger(__name__)

NOT_FOUND = {"type": "previous_message_not_found"}
PRUNE_EVERY_S = 60.0  # expired fingerprints are deleted at most this often per gateway


def answer(prev: Fingerprint | None, cur: Fingerprint) -> dict[str, Any] | None:
    """The response's ``diagnostics`` value for a turn naming ``prev`` (None: not found)."""
    if prev is None:
        return {"cache_miss_reason": NOT_FOUND}
    d = diagnose(prev, cur)
    if d is None or d.reason is None:
        # NOTE: Anthropic's null: the prompt did not change. A server-only reason (a
        # scope change, say) goes to the ledger and the trace, not here, where
        # {"cache_miss_reason": null} would read as "still pending".
        return None
    return {
        "cache_miss_reason": d.as_reason(),
        # NOTE: an extension the SDKs ignore: the server's own reason (more precise
        # where it knows more), where the prompts part, in tokens (full blocks shared),
        # and how much of it the earlier turn had cached.
        "cachepoint": {
            "reason": d.server_reason,
            "first_divergent_token": d.shared_tokens,
            "previous_cached_tokens": prev.cached_end,
        },
    }


NO_DIVERGENCE = "none"  # the ledger's word for "compared, and the prompt only appended"
SESSION_CANDIDATES = 8  # a session's recent turns a new turn may continue


@dataclass(frozen=True, slots=True)
class PreviousTurn:
    """The turn a request was compared with, as its fingerprint and ledger row tell it:
    what its cache entry should hold, where it lived, and until when."""

    replica: str  # the replica that served it
    at_s: int  # when it was billed: its entry's last refresh, in epoch seconds
    ttl_s: int  # its last breakpoint's TTL
    cached_end: int  # its last breakpoint: what a turn appending to it should read
    kept: int  # of it, what it read or wrote (its entries): less means not retained


def outcome_reason(
    prev: PreviousTurn,
    *,
    replica: str,
    read: int,
    now_s: float,
    replica_started_s: float | None,
) -> str | None:
    """Why a turn whose prompt only appended still read less than the turn before had
    cached; None when it read all of it. Only the server can say: the prompt was fine,
    the cache entry was not there.

    In order: the turn before never kept its entry (the replica refused its retention:
    share or org quota full), this turn went to another replica, that replica started
    since, the entry's TTL ran out, or else it was evicted under pressure.
    """
    if prev.cached_end == 0 or read >= prev.cached_end:
        return None
    if prev.kept < prev.cached_end:
        return "not_retained"
    if replica != prev.replica:
        return "routed_elsewhere"
    if replica_started_s is not None and replica_started_s > prev.at_s:
        return "replica_restarted"
    if now_s - prev.at_s > prev.ttl_s:
        return "entry_expired"
    return "entry_evicted"


@dataclass(frozen=True, slots=True)
class Diagnosed:
    """What a comparison gave: for the client (if it asked) and for the ledger."""

    answer: dict[str, Any] | None  # the response's `diagnostics` value
    reason: str | None  # the ledger's miss_reason (None: nothing to compare with)
    missed_tokens: int | None  # the ledger's miss_tokens, when the reason has them
    previous: PreviousTurn | None = None  # the turn compared with, when it was billed


NOT_COMPARED = Diagnosed(None, None, None)


def diagnosed(prev: Fingerprint | None, cur: Fingerprint, *, found: bool) -> Diagnosed:
    """The outcome of comparing ``cur`` with ``prev`` (``found``: a turn was named and
    looked up, but ``prev`` is None when it was not there). The ledger keeps the
    server's reason, which is Anthropic's or more precise."""
    out = answer(prev, cur)
    if prev is None:
        return Diagnosed(out, NOT_FOUND["type"] if found else None, None)
    d = diagnose(prev, cur)
    if d is None:
        return Diagnosed(out, NO_DIVERGENCE, None)
    carries = d.server_reason in REASONS_WITH_TOKENS or d.server_reason in SERVER_REASONS
    return Diagnosed(out, d.server_reason, d.missed_tokens if carries else None)


_USER_SESSION = re.compile(r"_session_([0-9A-Za-z-]{8,128})$")


def session_of(session_id: str | None, user_id: str | None) -> str | None:
    """The session a request belongs to: Claude Code's session header, else the session
    in ``metadata.user_id`` (a JSON object with ``session_id``, or the older
    ``user_..._session_<uuid>`` string)."""
    if session_id:
        return session_id
    if not user_id:
        return None
    if user_id.startswith("{"):
        try:
            value = json.loads(user_id).get("session_id")
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, str) and 0 < len(value) <= 128 else None
    m = _USER_SESSION.search(user_id)
    return m.group(1) if m else None


class FingerprintStore:
    """The ``prompt_fingerprints`` table: kept ``retention_s``, read only by their org
    and workspace. Calls block on the database: run them in a worker thread."""

    def __init__(
        self,
        engine: Engine,
        retention_s: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        self.retention_s = retention_s
        self.clock = clock
        self._last_prune = 0.0
        self._lock = threading.Lock()

    def _scoped(self, org_id: str, workspace_id: str | None, now: int) -> list[Any]:
        return [
            PromptFingerprint.org_id == org_id,
            PromptFingerprint.workspace_id.is_(None)
            if workspace_id is None
            else PromptFingerprint.workspace_id == workspace_id,
            PromptFingerprint.created_s >= now - self.retention_s,
        ]

    def record_and_diagnose(
        self,
        *,
        message_id: str,
        org_id: str,
        workspace_id: str | None,
        fp: Fingerprint,
        opted_in: bool,
        previous_id: str | None,
        session_id: str | None = None,
        api_key_id: str | None = None,
    ) -> Diagnosed:
        """`diagnose`, then `keep`: compare, then keep ``fp`` for the turns after."""
        d = self.diagnose(
            org_id=org_id,
            workspace_id=workspace_id,
            fp=fp,
            opted_in=opted_in,
            previous_id=previous_id,
            session_id=session_id,
            api_key_id=api_key_id,
        )
        self.keep(message_id, org_id, workspace_id, session_id, api_key_id, fp)
        return d

    def keep(
        self,
        message_id: str,
        org_id: str,
        workspace_id: str | None,
        session_id: str | None,
        api_key_id: str | None,
        fp: Fingerprint,
    ) -> None:
        """Keep ``fp`` under ``message_id`` for a later turn to be compared with (and
        delete the expired ones, at most once a minute).

        NOTE: on the request's path, in the same worker-thread hop as `diagnose`. Run
        after it, in the background, it measured slower (bench/RESULTS.md, issue 33):
        on SQLite it then contends with the ledger's write for the one writer."""
        now = int(self.clock())
        self._insert(message_id, org_id, workspace_id, session_id, api_key_id, fp, now)
        self._maybe_prune(now)

    def diagnose(
        self,
        *,
        org_id: str,
        workspace_id: str | None,
        fp: Fingerprint,
        opted_in: bool,
        previous_id: str | None,
        session_id: str | None = None,
        api_key_id: str | None = None,
    ) -> Diagnosed:
        """Compare ``fp`` with the turn before: the one ``previous_id`` names
        (``opted_in``), or else the turn of ``session_id`` it continues (most blocks in
        common among the session's recent turns; for a session's first turn, among the
        same key's recent turns that share a block)."""
        now = int(self.clock())
        scoped = self._scoped(org_id, workspace_id, now)
        result = NOT_COMPARED
        if opted_in and previous_id is not None:
            with self.engine.connect() as conn:
                row = conn.execute(
                    select(PromptFingerprint.data).where(
                        PromptFingerprint.message_id == previous_id, *scoped
                    )
                ).first()
                prev = self._decode(row[0] if row else None, previous_id)
                result = diagnosed(prev, fp, found=True)
                if prev is not None:
                    result = replace(result, previous=self._billed(conn, previous_id, prev))
        elif session_id is not None:
            with self.engine.connect() as conn:
                turns = self._recent(conn, PromptFingerprint.session_id == session_id, scoped)
                if not turns and api_key_id is not None:
                    # NOTE: a session's first turn continues, if anything, the same key's
                    # last session (a new Claude Code session in the same project reads
                    # the tools the last one cached): compared only if it shares a block.
                    turns = [
                        x
                        for x in self._recent(
                            conn, PromptFingerprint.api_key_id == api_key_id, scoped
                        )
                        if shared_blocks(x[1], fp) > 0
                    ]
                if turns:
                    # NOTE: max() keeps the first of equals, and rows come newest first:
                    # the most recent of the turns sharing the most. Claude Code's side
                    # requests (titles, summaries) share a session, not a prompt.
                    mid, prev = max(turns, key=lambda x: shared_blocks(x[1], fp))
                    found = diagnosed(prev, fp, found=True)
                    # NOTE: for the ledger only: a client that opted in with a null id
                    # asked for a first turn's answer (null), whatever its session holds.
                    billed = self._billed(conn, mid, prev)
                    result = Diagnosed(None, found.reason, found.missed_tokens, billed)
        return result

    def _recent(
        self, conn: Connection, which: Any, scoped: list[Any]
    ) -> list[tuple[str, Fingerprint]]:
        """The newest ``SESSION_CANDIDATES`` fingerprints matching ``which``, newest first."""
        rows = conn.execute(
            select(PromptFingerprint.message_id, PromptFingerprint.data)
            .where(which, *scoped)
            .order_by(PromptFingerprint.created_s.desc())
            .limit(SESSION_CANDIDATES)
        ).all()
        return [(mid, fp) for mid, data in rows if (fp := self._decode(data, mid))]

    @staticmethod
    def _billed(conn: Connection, message_id: str, fp: Fingerprint) -> PreviousTurn | None:
        """The turn's ledger row, read as what happened to its cache (None: not billed,
        say a stream still running)."""
        row = conn.execute(
            select(
                UsageRecord.replica,
                UsageRecord.created_s,
                UsageRecord.cache_read_input_tokens,
                UsageRecord.cache_write_5m_tokens,
                UsageRecord.cache_write_1h_tokens,
            ).where(UsageRecord.request_id == "req_" + message_id.removeprefix("msg_"))
        ).first()
        if row is None:
            return None
        replica, at_s, read, w5, w1 = row
        return PreviousTurn(replica, at_s, fp.cached_ttl_s, fp.cached_end, read + w5 + w1)

    @staticmethod
    def _decode(data: bytes | None, message_id: str) -> Fingerprint | None:
        if data is None:
            return None
        try:
            return Fingerprint.decode(data)
        except FingerprintError as exc:
            # NOTE: a row from another gateway version: as if never kept.
            log.info("fingerprint %s unreadable: %s", message_id, exc)
            return None

    def _insert(
        self,
        message_id: str,
        org_id: str,
        workspace_id: str | None,
        session_id: str | None,
        api_key_id: str | None,
        fp: Fingerprint,
        now: int,
    ) -> None:
        try:
            with self.engine.begin() as conn:
                conn.execute(
                    insert(PromptFingerprint),
                    [
                        {
                            "message_id": message_id,
                            "org_id": org_id,
                            "workspace_id": workspace_id,
                            "session_id": session_id,
                            "api_key_id": api_key_id,
                            "created_s": now,
                            "data": fp.encode(),
                        }
                    ],
                )
        except IntegrityError:
            # NOTE: response ids are unique per request; a second row under one id can
            # only be the same request again, and the first one stays.
            log.info("fingerprint %s already kept", message_id)

    def _maybe_prune(self, now: int) -> None:
        with self._lock:
            if now - self._last_prune < PRUNE_EVERY_S:
                return
            self._last_prune = now
        with self.engine.begin() as conn:
            conn.execute(
                delete(PromptFingerprint).where(
                    PromptFingerprint.created_s < now - self.retention_s
                )
            )
