"""Usage and cost reports in the shape of Anthropic's Admin API (contract §3, Billing).

Rows are bucketed in SQL on integer epoch seconds, which SQLite and PostgreSQL both
do the same way; every bucket in the window is returned, empty ones included.
"""

from __future__ import annotations

import base64
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from cachepoint.billing import Buckets, Price, uncached_cost_micros
from cachepoint.gateway.db.models import UsageRecord

WIDTHS = {"1m": 60, "1h": 3600, "1d": 86400}
LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}  # (default, max) buckets a page
# NOTE: the first three are Anthropic's and every result names them (None when not
# grouped); session_id, user_id, miss_reason (cache diagnostics' reason against the
# turn before: gateway/diagnostics.py) and api (messages, chat.completions, completions)
# are ours and appear only when grouped by.
ANTHROPIC_GROUPS = ("model", "api_key_id", "workspace_id")
USAGE_GROUPS = {*ANTHROPIC_GROUPS, "session_id", "user_id", "miss_reason", "api"}
COST_GROUPS = {*USAGE_GROUPS, "description"}
TOKEN_FIELDS = (
    "input_tokens",
    "cache_read_input_tokens",
    "cache_write_5m_tokens",
    "cache_write_1h_tokens",
    "output_tokens",
)


class ReportError(ValueError):
    """A bad report parameter; the message names it."""


class OutOfRange(ReportError):
    """A timestamp outside what the reports support; the message names the range."""


@dataclass(frozen=True, slots=True)
class ReportQuery:
    org_id: str
    start: datetime  # first bucket's start (snapped)
    end: datetime  # buckets must end at or before this
    width: str  # 1m | 1h | 1d
    group_by: tuple[str, ...]
    limit: int
    models: tuple[str, ...] = ()
    api_key_ids: tuple[str, ...] = ()
    workspace_ids: tuple[str, ...] = ()
    session_ids: tuple[str, ...] = ()  # X-Claude-Code-Session-Id values
    user_ids: tuple[str, ...] = ()  # metadata.user_id values, as sent


# NOTE: buckets are counted in integer seconds from the epoch and turned into datetimes
# only for starts and ends that lie within the window, so no width x limit step can leave
# datetime's range; what is left to refuse is a timestamp that is itself outside it in
# UTC (a year-1 time east of UTC, a 9999-12-31 time west of it).
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
EARLIEST = datetime.min.replace(tzinfo=UTC)
LATEST = datetime.max.replace(microsecond=0, tzinfo=UTC)
_SECOND = timedelta(seconds=1)


def rfc3339(t: datetime) -> str:
    """``t`` in UTC as RFC 3339 to the second, e.g. ``0001-01-01T00:00:00Z``.

    NOTE: formatted field by field: ``strftime("%Y")`` gives "1" for year 1 on Linux,
    which is not RFC 3339 (it needs four digits)."""
    t = t.astimezone(UTC) if t.tzinfo is not None else t
    return f"{t.year:04d}-{t.month:02d}-{t.day:02d}T{t.hour:02d}:{t.minute:02d}:{t.second:02d}Z"


_RANGE = f"{rfc3339(EARLIEST)} to {rfc3339(LATEST)}"


def parse_time(name: str, value: str) -> datetime:
    """An RFC 3339 (or ISO 8601) timestamp in UTC; naive ones are taken as UTC."""
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ReportError(f"{name}: not an RFC 3339 timestamp: {value!r}") from None
    try:
        return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)
    except OverflowError:
        raise OutOfRange(
            f"{name}: {value!r} is outside the supported range, {_RANGE} (UTC)"
        ) from None


def _secs(t: datetime) -> int:
    """Whole seconds since the epoch, floored (exact: no float on the way)."""
    return (t - EPOCH) // _SECOND


def _at(secs: int) -> datetime:
    """The UTC datetime ``secs`` after the epoch (before it when negative)."""
    return EPOCH + timedelta(seconds=secs)


def _snap(t: datetime, width: str) -> datetime:
    secs = WIDTHS[width]
    return _at(_secs(t) // secs * secs)


def encode_page(start: datetime) -> str:
    return "page_" + base64.urlsafe_b64encode(rfc3339(start).encode()).decode()


def _decode_page(page: str, width: str) -> datetime:
    try:
        raw = base64.urlsafe_b64decode(page.removeprefix("page_").encode()).decode()
    except ValueError:  # binascii.Error and UnicodeDecodeError both are
        raw = ""
    try:
        start = parse_time("page", raw)
    except OutOfRange:
        raise
    except ReportError:
        raise ReportError("page: not a page token from a previous response") from None
    # NOTE: a token this gateway wrote is a bucket start already; a forged one is
    # snapped like starting_at so its buckets line up with the ledger's.
    return _snap(start, width)


def parse_query(
    org_id: str, params: list[tuple[str, str]], allowed_groups: set[str], widths: Iterable[str]
) -> ReportQuery:
    """Query-string parameters (both ``group_by`` and ``group_by[]`` forms) to a query."""
    multi: dict[str, list[str]] = defaultdict(list)
    for k, v in params:
        multi[k.removesuffix("[]")].append(v)
    known = {"starting_at", "ending_at", "bucket_width", "group_by", "limit", "page"}
    known |= {"models", "api_key_ids", "workspace_ids", "session_ids", "user_ids"}
    unknown = sorted(set(multi) - known)
    if unknown:
        raise ReportError(f"{unknown[0]}: unknown parameter")
    if not multi.get("starting_at"):
        raise ReportError("starting_at: required")
    width = (multi.get("bucket_width") or ["1d"])[-1]
    if width not in widths:
        raise ReportError(f"bucket_width: must be one of {', '.join(sorted(widths))}")
    groups = tuple(dict.fromkeys(multi.get("group_by", [])))
    bad = [g for g in groups if g not in allowed_groups]
    if bad:
        raise ReportError(f"group_by: {bad[0]!r} is not one of {', '.join(sorted(allowed_groups))}")
    default_limit, max_limit = LIMITS[width]
    try:
        limit = int((multi.get("limit") or [default_limit])[-1])
    except ValueError:
        raise ReportError("limit: must be an integer") from None
    if not 1 <= limit <= max_limit:
        raise ReportError(f"limit: must be within 1..{max_limit} for bucket_width {width}")
    start = _snap(parse_time("starting_at", multi["starting_at"][-1]), width)
    if multi.get("page"):
        start = _decode_page(multi["page"][-1], width)
    end = parse_time("ending_at", multi["ending_at"][-1]) if multi.get("ending_at") else None
    if end is None:
        # No end: up to and including the bucket that holds "now".
        end = _snap(datetime.now(UTC), width) + timedelta(seconds=WIDTHS[width])
    if end <= start:
        raise ReportError("ending_at: must be after starting_at")
    return ReportQuery(
        org_id=org_id,
        start=start,
        end=end,
        width=width,
        group_by=groups,
        limit=limit,
        models=tuple(multi.get("models", [])),
        api_key_ids=tuple(multi.get("api_key_ids", [])),
        workspace_ids=tuple(multi.get("workspace_ids", [])),
        session_ids=tuple(multi.get("session_ids", [])),
        user_ids=tuple(multi.get("user_ids", [])),
    )


def _buckets(q: ReportQuery) -> tuple[list[datetime], bool]:
    """The page's bucket starts (each bucket ends at or before ``q.end``), and whether
    another bucket follows. In integer seconds: see EPOCH."""
    step = WIDTHS[q.width]
    end = _secs(q.end)
    t = _secs(q.start)
    out: list[datetime] = []
    while t + step <= end and len(out) < q.limit:
        out.append(_at(t))
        t += step
    return out, t + step <= end


def _rows(session: Session, q: ReportQuery, starts: list[datetime], groups: tuple[str, ...]):
    secs = WIDTHS[q.width]
    # NOTE: SQL's % truncates towards zero (SQLite and PostgreSQL alike); the second %
    # floors it as _snap does, so a row before 1970 falls in its own bucket too.
    bucket = (UsageRecord.created_s - (UsageRecord.created_s % secs + secs) % secs).label("bucket")
    cols = [getattr(UsageRecord, g) for g in groups]
    sums = [func.sum(getattr(UsageRecord, f)).label(f) for f in TOKEN_FIELDS]
    sums.append(func.sum(UsageRecord.cost_micros).label("cost_micros"))
    lo = _secs(starts[0])
    hi = _secs(starts[-1]) + secs
    stmt = (
        select(bucket, *cols, *sums)
        .where(UsageRecord.org_id == q.org_id)
        .where(UsageRecord.created_s >= lo, UsageRecord.created_s < hi)
    )
    if q.models:
        stmt = stmt.where(UsageRecord.model.in_(q.models))
    if q.api_key_ids:
        stmt = stmt.where(UsageRecord.api_key_id.in_(q.api_key_ids))
    if q.workspace_ids:
        stmt = stmt.where(UsageRecord.workspace_id.in_(q.workspace_ids))
    if q.session_ids:
        stmt = stmt.where(UsageRecord.session_id.in_(q.session_ids))
    if q.user_ids:
        stmt = stmt.where(UsageRecord.user_id.in_(q.user_ids))
    stmt = stmt.group_by(bucket, *cols).order_by(bucket, *cols)
    return session.execute(stmt).all()


def _page(q: ReportQuery, starts: list[datetime], has_more: bool, results: dict[int, list[Any]]):
    step = timedelta(seconds=WIDTHS[q.width])
    data = [
        {
            "starting_at": rfc3339(s),
            # NOTE: within range: _buckets keeps only buckets that end by q.end.
            "ending_at": rfc3339(s + step),
            "results": results.get(_secs(s), []),
        }
        for s in starts
    ]
    nxt = encode_page(starts[-1] + step) if has_more and starts else None
    return {"data": data, "has_more": has_more, "next_page": nxt}


def usage_report(session: Session, q: ReportQuery) -> dict[str, Any]:
    starts, has_more = _buckets(q)
    results: dict[int, list[Any]] = defaultdict(list)
    if starts:
        for row in _rows(session, q, starts, q.group_by):
            m = row._mapping
            item: dict[str, Any] = {g: None for g in ANTHROPIC_GROUPS}
            item.update({g: m[g] for g in q.group_by})
            item.update(
                uncached_input_tokens=int(m["input_tokens"]),
                cache_read_input_tokens=int(m["cache_read_input_tokens"]),
                cache_creation={
                    "ephemeral_5m_input_tokens": int(m["cache_write_5m_tokens"]),
                    "ephemeral_1h_input_tokens": int(m["cache_write_1h_tokens"]),
                },
                output_tokens=int(m["output_tokens"]),
                server_tool_use=None,
            )
            results[int(m["bucket"])].append(item)
    return _page(q, starts, has_more, results)


def cents(micros: Fraction | int) -> str:
    """Micro-dollars as a decimal string of cents, the Admin API's unit."""
    value = Decimal(Fraction(micros).numerator) / Decimal(Fraction(micros).denominator)
    return str((value / 10_000).quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP))


_TOKEN_TYPES = (
    ("input_tokens", "uncached_input_tokens", "Input"),
    ("cache_read_input_tokens", "cache_read_input_tokens", "Cache read"),
    ("cache_write_5m_tokens", "cache_creation.ephemeral_5m_input_tokens", "Cache write 5m"),
    ("cache_write_1h_tokens", "cache_creation.ephemeral_1h_input_tokens", "Cache write 1h"),
    ("output_tokens", "output_tokens", "Output"),
)


def cost_report(session: Session, q: ReportQuery, price_of: Any) -> dict[str, Any]:
    """``price_of(model) -> Price``. Without ``description`` the amounts are the ledger's
    own per-request costs summed; with it, each token type is priced at report time."""
    starts, has_more = _buckets(q)
    by_desc = "description" in q.group_by
    groups = tuple(g for g in q.group_by if g != "description")
    if by_desc and "model" not in groups:
        groups = (*groups, "model")
    results: dict[int, list[Any]] = defaultdict(list)
    if starts:
        for row in _rows(session, q, starts, groups):
            m = row._mapping
            base: dict[str, Any] = {"currency": "USD", "cost_type": None, "token_type": None}
            base.update({"workspace_id": None, "model": None, "description": None})
            base.update({g: m[g] for g in groups})
            if not by_desc:
                results[int(m["bucket"])].append({**base, "amount": cents(int(m["cost_micros"]))})
                continue
            price: Price = price_of(m["model"])
            rates = {
                "input_tokens": Fraction(price.input_per_mtok),
                "cache_read_input_tokens": price.input_per_mtok * price.read_mult,
                "cache_write_5m_tokens": price.input_per_mtok * price.write_5m_mult,
                "cache_write_1h_tokens": price.input_per_mtok * price.write_1h_mult,
                "output_tokens": Fraction(price.output_per_mtok),
            }
            for field, token_type, label in _TOKEN_TYPES:
                n = int(m[field])
                if not n:
                    continue
                results[int(m["bucket"])].append(
                    {
                        **base,
                        "cost_type": "tokens",
                        "token_type": token_type,
                        "description": f"{m['model']} {label}",
                        "amount": cents(n * rates[field] / 1_000_000),
                    }
                )
    return _page(q, starts, has_more, results)


@dataclass(slots=True)
class SpendRow:
    """One group's tokens and money over one bucket (or the whole window)."""

    starting_at: str  # the bucket's start (the first bucket's, for a window total)
    group: dict[str, Any]  # group-by column -> value
    tokens: dict[str, int]  # TOKEN_FIELDS -> sum
    cost_micros: int  # what the ledger billed: its per-request costs summed
    uncached_micros: int  # the same tokens with no caching, at today's prices

    @property
    def saved_micros(self) -> int:
        """What the cache saved: cost without caching minus cost."""
        return self.uncached_micros - self.cost_micros


def spend(session: Session, q: ReportQuery, price_of: Any, total: bool = False) -> list[SpendRow]:
    """Per bucket (or, with ``total``, per whole window) and group: the four buckets,
    the billed cost and what it would have cost uncached. ``price_of(model) -> Price``.

    NOTE: the uncached figure prices each model's summed tokens at report time; the
    cost is the ledger's own. A price changed inside the window skews the saving by
    the change, never the cost."""
    starts, _ = _buckets(q)
    if not starts:
        return []
    groups = q.group_by
    rows = _rows(session, q, starts, (*groups, *(() if "model" in groups else ("model",))))
    first = rfc3339(starts[0])
    out: dict[tuple[Any, ...], SpendRow] = {}
    for row in rows:
        m = row._mapping
        start = first if total else rfc3339(_at(int(m["bucket"])))
        key = (start, *(m[g] for g in groups))
        tokens = {f: int(m[f]) for f in TOKEN_FIELDS}
        b = Buckets(*(tokens[f] for f in TOKEN_FIELDS))
        uncached = uncached_cost_micros(b, price_of(m["model"]))
        got = out.get(key)
        if got is None:
            out[key] = SpendRow(start, {g: m[g] for g in groups}, tokens, 0, 0)
            got = out[key]
        else:
            for f in TOKEN_FIELDS:
                got.tokens[f] += tokens[f]
        got.cost_micros += int(m["cost_micros"])
        got.uncached_micros += uncached
    return list(out.values())


def usd(micros: int) -> str:
    """Micro-dollars as dollars, to the micro-dollar."""
    return f"{Decimal(micros) / 1_000_000:.6f}"
