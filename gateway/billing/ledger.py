"""The usage ledger: one row per billed request, written before the response leaves."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction
from typing import Any

from sqlalchemy import Connection, Engine, insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cachepoint.billing import BillingError, Buckets, Price, cost_micros
from cachepoint.billing import buckets as split_buckets
from cachepoint.gateway.db.models import ModelPrice, UsageRecord

# NOTE: one prebuilt insert with bound parameters: a fresh .values() statement per
# row is recompiled every time (measured 4x slower on SQLite).
_INSERT = insert(UsageRecord)


@dataclass(frozen=True, slots=True)
class Attribution:
    """Who and what a charge belongs to beyond the key: for per-session reports."""

    session_id: str | None = None  # X-Claude-Code-Session-Id, when well formed
    user_id: str | None = None  # metadata.user_id as sent (Claude Code: a JSON string)
    requested_model: str | None = None  # the client's model name when an alias resolved it
    # cache diagnostics against the turn before (gateway/diagnostics.py): the
    # cache_miss_reason type, "none" when the prompt only appended, None when not compared
    miss_reason: str | None = None
    miss_tokens: int | None = None  # its cache_missed_input_tokens, when it has them
    # what happened to the entry, in a few words: "tier host" for an evicted entry's
    # last tier, "entry on r0" for one routed elsewhere (None: nothing to add)
    miss_detail: str | None = None
    api: str = "messages"  # the API the request came to: messages, chat.completions, completions
    cache_key: str | None = None  # OpenAI's prompt_cache_key, as sent


NO_ATTRIBUTION = Attribution()


@dataclass(frozen=True, slots=True)
class Charge:
    request_id: str
    org_id: str
    workspace_id: str | None
    api_key_id: str
    model: str  # the served model: what is priced
    replica: str
    scope: str
    buckets: Buckets
    who: Attribution = NO_ATTRIBUTION  # session, user, requested name


def price_for(session: Session, model: str, default: Price) -> Price:
    row = session.get(ModelPrice, model)
    if row is None:
        return default
    return Price(
        input_per_mtok=row.input_per_mtok,
        output_per_mtok=row.output_per_mtok,
        write_5m_mult=Fraction(Decimal(row.write_5m_mult)),
        write_1h_mult=Fraction(Decimal(row.write_1h_mult)),
        read_mult=Fraction(Decimal(row.read_mult)),
    )


def record(session: Session, charge: Charge, price: Price, now: datetime | None = None) -> bool:
    """Insert the usage row and commit. False when this request id was already billed."""
    try:
        session.execute(_INSERT, [_row(charge, price, now)])
        session.commit()
    except IntegrityError:
        session.rollback()
        return False
    return True


def record_on(
    engine: Engine,
    charge: Charge,
    price: Price,
    *,
    now: datetime | None = None,
    also: Callable[[Connection], None] | None = None,
) -> bool:
    """`record` on a bare connection: the request path's version. ``also`` writes what
    belongs with the row in the same transaction (the request's prompt fingerprint),
    and only if the row is new.

    NOTE: a Session costs about 250 µs a commit on top of SQLite's own work; the
    ledger insert needs none of its unit-of-work machinery.
    """
    try:
        with engine.begin() as conn:
            conn.execute(_INSERT, [_row(charge, price, now)])
            if also is not None:
                also(conn)
    except IntegrityError:
        return False
    return True


def _row(charge: Charge, price: Price, now: datetime | None) -> dict[str, object]:
    now = now or datetime.now(UTC)
    b = charge.buckets
    return {
        "request_id": charge.request_id,
        "org_id": charge.org_id,
        "workspace_id": charge.workspace_id,
        "api_key_id": charge.api_key_id,
        "model": charge.model,
        "replica": charge.replica,
        "scope": charge.scope,
        "input_tokens": b.input_tokens,
        "cache_read_input_tokens": b.cache_read_input_tokens,
        "cache_write_5m_tokens": b.cache_write_5m_tokens,
        "cache_write_1h_tokens": b.cache_write_1h_tokens,
        "output_tokens": b.output_tokens,
        "cost_micros": cost_micros(b, price),
        "created_at": now,
        "created_s": int(now.timestamp()),
        "requested_model": charge.who.requested_model,
        "session_id": charge.who.session_id,
        "user_id": charge.who.user_id,
        "miss_reason": charge.who.miss_reason,
        "miss_tokens": charge.who.miss_tokens,
        "miss_detail": charge.who.miss_detail,
        "api": charge.who.api,
        "prompt_cache_key": charge.who.cache_key,
    }


def charge_to_json(charge: Charge) -> str:
    """A charge as JSON, to be billed later by another process (a crashed stream's
    progress on its idempotency row, billed by the retry that takes the key over)."""
    return json.dumps(asdict(charge), separators=(",", ":"))


def _opt(value: object, kind: type) -> Any:
    """``value`` if it is None or of ``kind`` (a field older writers left out)."""
    if value is not None and type(value) is not kind:
        raise TypeError(f"{value!r} is not a {kind.__name__}")
    return value


def charge_from_json(raw: str) -> Charge:
    """The charge `charge_to_json` wrote; ValueError if it is not one (every count a
    non-negative int, every label a string)."""
    try:
        d = json.loads(raw)
        b, who = d["buckets"], d["who"]
        counts = [
            b["input_tokens"],
            b["cache_read_input_tokens"],
            b["cache_write_5m_tokens"],
            b["cache_write_1h_tokens"],
            b["output_tokens"],
        ]
        if not all(type(n) is int for n in counts):
            raise TypeError("token counts must be integers")
        prompt = sum(counts[:4])
        split = split_buckets(prompt, counts[1], counts[2], counts[3], counts[4])
        labels = [d[k] for k in ("request_id", "org_id", "api_key_id", "model", "replica")]
        optional = [d["workspace_id"], who["session_id"], who["user_id"], who["requested_model"]]
        labelled = all(isinstance(x, str) for x in [*labels, d["scope"]])
        if not labelled or not all(x is None or isinstance(x, str) for x in optional):
            raise TypeError("labels must be strings")
        return Charge(
            d["request_id"],
            d["org_id"],
            d["workspace_id"],
            d["api_key_id"],
            d["model"],
            d["replica"],
            d["scope"],
            split,
            Attribution(
                who["session_id"],
                who["user_id"],
                who["requested_model"],
                _opt(who.get("miss_reason"), str),
                _opt(who.get("miss_tokens"), int),
                _opt(who.get("miss_detail"), str),
                _opt(who.get("api"), str) or "messages",
                _opt(who.get("cache_key"), str),
            ),
        )
    except (KeyError, TypeError, BillingError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a recorded charge: {exc!r}") from None
