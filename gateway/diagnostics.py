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
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, delete, insert, select
from sqlalchemy.exc import IntegrityError

from cachepoint.gateway.contract.fingerprint import (
    REASONS_WITH_TOKENS,
    Fingerprint,
    FingerprintError,
    diagnose,
    shared_blocks,
)
from cachepoint.gateway.db.models import PromptFingerprint

log = logging.getLogger(__name__)

NOT_FOUND = {"type": "previous_message_not_found"}
PRUNE_EVERY_S = 60.0  # expired fingerprints are deleted at most this often per gateway


def answer(prev: Fingerprint | None, cur: Fingerprint) -> dict[str, Any] | None:
    """The response's ``diagnostics`` value for a turn naming ``prev`` (None: not found)."""
    if prev is None:
        return {"cache_miss_reason": NOT_FOUND}
    d = diagnose(prev, cur)
    if d is None:
        return None
    return {
        "cache_miss_reason": d.as_reason(),
        # NOTE: an extension the SDKs ignore: where the prompts part, in tokens (full
        # blocks shared), and how much of it the earlier turn had cached.
        "cachepoint": {
            "first_divergent_token": d.shared_tokens,
            "previous_cached_tokens": prev.cached_end,
        },
    }


NO_DIVERGENCE = "none"  # the ledger's word for "compared, and the prompt only appended"
SESSION_CANDIDATES = 8  # a session's recent turns a new turn may continue


@dataclass(frozen=True, slots=True)
class Diagnosed:
    """What a comparison gave: for the client (if it asked) and for the ledger."""

    answer: dict[str, Any] | None  # the response's `diagnostics` value
    reason: str | None  # the ledger's miss_reason (None: nothing to compare with)
    missed_tokens: int | None  # the ledger's miss_tokens, when the reason has them


NOT_COMPARED = Diagnosed(None, None, None)


def diagnosed(prev: Fingerprint | None, cur: Fingerprint, *, found: bool) -> Diagnosed:
    """The outcome of comparing ``cur`` with ``prev`` (``found``: a turn was named and
    looked up, but ``prev`` is None when it was not there)."""
    out = answer(prev, cur)
    if prev is None:
        return Diagnosed(out, NOT_FOUND["type"] if found else None, None)
    d = diagnose(prev, cur)
    if d is None:
        return Diagnosed(out, NO_DIVERGENCE, None)
    tokens = d.missed_tokens if d.reason in REASONS_WITH_TOKENS else None
    return Diagnosed(out, d.reason, tokens)


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
    ) -> Diagnosed:
        """Keep ``fp`` under ``message_id`` and compare it with the turn before: the one
        ``previous_id`` names (``opted_in``), or else the turn of ``session_id`` it
        continues (most blocks in common among the session's recent turns)."""
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
            result = diagnosed(self._decode(row[0] if row else None, previous_id), fp, found=True)
        elif session_id is not None:
            with self.engine.connect() as conn:
                rows = conn.execute(
                    select(PromptFingerprint.message_id, PromptFingerprint.data)
                    .where(PromptFingerprint.session_id == session_id, *scoped)
                    .order_by(PromptFingerprint.created_s.desc())
                    .limit(SESSION_CANDIDATES)
                ).all()
            turns = [t for mid, data in rows if (t := self._decode(data, mid)) is not None]
            if turns:
                # NOTE: max() keeps the first of equals, and rows come newest first: the
                # most recent of the turns sharing the most. Claude Code's side requests
                # (titles, summaries) share a session but not a prompt with its turns.
                prev = max(turns, key=lambda t: shared_blocks(t, fp))
                found = diagnosed(prev, fp, found=True)
                # NOTE: for the ledger only: a client that opted in with a null id asked
                # for a first turn's answer (null), whatever its session holds.
                result = Diagnosed(None, found.reason, found.missed_tokens)
        self._insert(message_id, org_id, workspace_id, session_id, fp, now)
        self._maybe_prune(now)
        return result

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
