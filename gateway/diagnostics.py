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
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

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

T = TypeVar("T", bound=tuple[Any, ...])

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
    # when it was billed (its entry's last refresh), in epoch seconds: exact from this
    # gateway's memory; from the ledger, whose times are whole seconds, the end of that
    # second (a restart is not claimed for a replica that may have started before it)
    at_s: float
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


@dataclass(slots=True)
class Kept:
    """A fingerprint this gateway keeps in memory: whose it is, and, once its ledger row
    is written, what happened to its cache."""

    message_id: str  # the response id a later turn names
    org_id: str
    workspace_id: str | None
    session_id: str | None
    api_key_id: str | None
    created_s: int  # when it was kept, in epoch seconds: it expires retention_s later
    fp: Fingerprint
    billed: PreviousTurn | None = None  # set when its ledger row is written
    stored: bool = False  # its row is in the database (written with its ledger row)

    def owned_by(self, org_id: str, workspace_id: str | None) -> bool:
        return self.org_id == org_id and self.workspace_id == workspace_id


MEMORY_TURNS = 8192  # fingerprints one gateway keeps in memory (about 600 bytes each)


class FingerprintStore:
    """Prompt fingerprints: the recent ones in this gateway's memory, every one in the
    ``prompt_fingerprints`` table for ``retention_s``, read only by their org and
    workspace.

    NOTE: the request path reads memory (`diagnose_recent`), and the row is written
    with the request's ledger row, in its transaction (`writer`, `billed`): measured,
    a read and an insert of their own per request cost the gateway 3 ms (issue 33). The
    database answers what memory cannot: a turn this gateway never saw (another
    gateway's, or before a restart), in `diagnose`, which blocks (a worker thread).
    """

    def __init__(
        self,
        engine: Engine,
        retention_s: int,
        clock: Callable[[], float] = time.time,
        memory_turns: int = MEMORY_TURNS,
    ) -> None:
        self.engine = engine
        self.retention_s = retention_s
        self.clock = clock
        self.memory_turns = memory_turns
        self._last_prune = 0.0
        self._lock = threading.Lock()
        # message id -> Kept, oldest first
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        # (org, workspace, session or key) -> its newest message ids, newest last
        self._sessions: OrderedDict[tuple[str, str | None, str], deque[str]] = OrderedDict()
        self._keys: OrderedDict[tuple[str, str | None, str], deque[str]] = OrderedDict()

    # ------------------------------------------------------------------ memory

    def remember(
        self,
        message_id: str,
        org_id: str,
        workspace_id: str | None,
        session_id: str | None,
        api_key_id: str | None,
        fp: Fingerprint,
    ) -> None:
        """Keep ``fp`` for the turns after (its row is written with its ledger row)."""
        kept = Kept(message_id, org_id, workspace_id, session_id, api_key_id, int(self.clock()), fp)
        with self._lock:
            self._kept[message_id] = kept
            if len(self._kept) > self.memory_turns:
                self._kept.popitem(last=False)
            if session_id is not None:
                self._index(self._sessions, (org_id, workspace_id, session_id), message_id)
            if api_key_id is not None:
                self._index(self._keys, (org_id, workspace_id, api_key_id), message_id)

    def _index(
        self,
        index: OrderedDict[tuple[str, str | None, str], deque[str]],
        key: tuple[str, str | None, str],
        message_id: str,
    ) -> None:
        ids = index.get(key)
        if ids is None:
            ids = index[key] = deque(maxlen=SESSION_CANDIDATES)
            if len(index) > self.memory_turns:
                index.popitem(last=False)
        else:
            index.move_to_end(key)
        ids.append(message_id)

    def _live(self, kept: Kept | None, now: int) -> Kept | None:
        return kept if kept is not None and kept.created_s >= now - self.retention_s else None

    def _turns(
        self, index: OrderedDict[tuple[str, str | None, str], deque[str]], key: tuple, now: int
    ) -> list[tuple[str, Fingerprint, PreviousTurn | None]] | None:
        """``key``'s turns in memory, newest first; None when memory has none of them."""
        ids = index.get(key)
        if ids is None:
            return None
        turns = [k for m in reversed(ids) if (k := self._live(self._kept.get(m), now))]
        return [(k.message_id, k.fp, k.billed) for k in turns] or None

    def diagnose_recent(
        self,
        *,
        org_id: str,
        workspace_id: str | None,
        fp: Fingerprint,
        opted_in: bool,
        previous_id: str | None,
        session_id: str | None = None,
        api_key_id: str | None = None,
    ) -> Diagnosed | None:
        """`diagnose` from memory alone, without blocking; None when the turn before
        may be only in the database."""
        now = int(self.clock())
        with self._lock:
            if opted_in and previous_id is not None:
                kept = self._live(self._kept.get(previous_id), now)
                if kept is None:
                    return None
                if not kept.owned_by(org_id, workspace_id):
                    return diagnosed(None, fp, found=True)  # as if never kept: not found
                return replace(diagnosed(kept.fp, fp, found=True), previous=kept.billed)
            if session_id is None:
                return NOT_COMPARED
            turns = self._turns(self._sessions, (org_id, workspace_id, session_id), now)
            if turns is None and api_key_id is not None:
                turns = self._turns(self._keys, (org_id, workspace_id, api_key_id), now)
                if turns is None:
                    return None
                turns = [t for t in turns if shared_blocks(t[1], fp) > 0]
            if turns is None:
                return None
        if not turns:
            return NOT_COMPARED
        _, prev, billed = _closest(turns, fp)
        return _continued(prev, fp, billed)

    def writer(self, request_id: str) -> Callable[[Connection], None] | None:
        """What writes ``request_id``'s fingerprint row in its ledger row's transaction
        (`record_on`'s ``also``); None when it has none to write."""
        with self._lock:
            kept = self._kept.get("msg_" + request_id.removeprefix("req_"))
        if kept is None or kept.stored:
            return None
        row = {
            "message_id": kept.message_id,
            "org_id": kept.org_id,
            "workspace_id": kept.workspace_id,
            "session_id": kept.session_id,
            "api_key_id": kept.api_key_id,
            "created_s": kept.created_s,
            "data": kept.fp.encode(),
        }

        def write(conn: Connection) -> None:
            conn.execute(_insert_new(conn), [row])

        return write

    def billed(self, request_id: str, *, replica: str, at_s: float, kept_tokens: int) -> None:
        """``request_id``'s ledger row (and so its fingerprint's) is written: what its
        cache entry should hold, where, and since when, for the turn after."""
        with self._lock:
            kept = self._kept.get("msg_" + request_id.removeprefix("req_"))
            if kept is None:
                return
            kept.stored = True
            fp = kept.fp
            kept.billed = PreviousTurn(replica, at_s, fp.cached_ttl_s, fp.cached_end, kept_tokens)

    # ------------------------------------------------------------------ database

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
        """Compare ``fp`` with the turn before, from the database: the one
        ``previous_id`` names (``opted_in``), or else the turn of ``session_id`` it
        continues (most blocks in common among the session's recent turns; for a
        session's first turn, among the same key's recent turns that share a block)."""
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
                    mid, prev = _closest(turns, fp)
                    result = _continued(prev, fp, self._billed(conn, mid, prev))
        return result

    def prune(self) -> None:
        """Delete the expired rows, at most once a minute (a worker thread)."""
        now = int(self.clock())
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

    def _scoped(self, org_id: str, workspace_id: str | None, now: int) -> list[Any]:
        return [
            PromptFingerprint.org_id == org_id,
            PromptFingerprint.workspace_id.is_(None)
            if workspace_id is None
            else PromptFingerprint.workspace_id == workspace_id,
            PromptFingerprint.created_s >= now - self.retention_s,
        ]

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
        kept = read + w5 + w1
        return PreviousTurn(replica, at_s + 1.0, fp.cached_ttl_s, fp.cached_end, kept)

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


def _closest(turns: list[T], fp: Fingerprint) -> T:
    """Of ``turns`` (newest first, each with its fingerprint second), the one ``fp``
    continues: the one it shares the most blocks with.

    NOTE: max() keeps the first of equals, and turns come newest first: the most recent
    of the turns sharing the most. Claude Code's side requests (titles, summaries)
    share a session, not a prompt."""
    return max(turns, key=lambda t: shared_blocks(t[1], fp))


def _continued(prev: Fingerprint, fp: Fingerprint, billed: PreviousTurn | None) -> Diagnosed:
    """The session path's outcome, for the ledger only: a client that opted in with a
    null id asked for a first turn's answer (null), whatever its session holds."""
    found = diagnosed(prev, fp, found=True)
    return Diagnosed(None, found.reason, found.missed_tokens, billed)


def _insert_new(conn: Connection) -> Any:
    """An insert of a fingerprint row that keeps the first of two under one id (the
    same request billed again cannot get here: its ledger row is refused first)."""
    if conn.dialect.name == "postgresql":
        return pg_insert(PromptFingerprint).on_conflict_do_nothing()
    return sqlite_insert(PromptFingerprint).on_conflict_do_nothing()
