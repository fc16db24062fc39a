"""`cachepoint-admin`: orgs, workspaces, keys, scope policy, prices, model aliases and
usage tables.

Every command takes ``--db URL`` (default: the embedded stack's SQLite file) and
migrates that database first, so it works on a fresh one.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from cachepoint.billing import Price
from cachepoint.gateway.admin.safe_text import csv_text, visible
from cachepoint.gateway.admin.session_png import PictureError, draw
from cachepoint.gateway.admin.sessions import Turn, turns
from cachepoint.gateway.billing.ledger import price_for
from cachepoint.gateway.billing.reports import (
    LIMITS,
    TOKEN_FIELDS,
    USAGE_GROUPS,
    WIDTHS,
    ReportError,
    parse_query,
    parse_time,
    spend,
    usd,
)
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.models import (
    ApiKey,
    ModelAlias,
    ModelPrice,
    Org,
    UsageRecord,
    Workspace,
)
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.diagnostics import NO_DIVERGENCE
from cachepoint.gateway.settings import DEFAULT_DB, GatewaySettings
from cachepoint.gateway.tenancy import aliases
from cachepoint.gateway.tenancy.tenants import (
    TenantError,
    create_key,
    create_org,
    create_workspace,
    get_org,
    get_workspace,
    revoke_key,
    set_policy,
)

# NOTE: piped into a script there is no terminal width; never truncate an id there.
out = Console(width=None if Console().is_terminal else 200)
err = Console(stderr=True, width=200)


# ------------------------------------------------------------------ output
# NOTE: names, ids, models and metadata.user_id come from tenants and operators. Rich
# reads a str as console markup ("[link=...]" writes a terminal hyperlink, an unbalanced
# "[/b]" raises) and emoji codes, and passes escape sequences through; so every such
# text goes out as a Text (no markup) with its control characters made visible.


def _safe(value: object) -> Text:
    return Text(visible(str(value)))


def _say(message: str, console: Console | None = None) -> None:
    """Print one line that may hold stored or typed names (on ``out`` by default)."""
    (console or out).print(_safe(message))


def _table(*cols: str, title: str | None = None) -> Table:
    return Table(*cols, title=None if title is None else _safe(title))


def _add_row(t: Table, *cells: object) -> None:
    """A row of any values, each shown as escaped plain text."""
    t.add_row(*(_safe(c) for c in cells))


def _minute(t: datetime) -> str:
    """To the minute, year in four digits (see reports.rfc3339 for why not strftime)."""
    return f"{t.year:04d}-{t.month:02d}-{t.day:02d} {t.hour:02d}:{t.minute:02d}"


def _usd_per_mtok(text: str) -> int:
    try:
        micros = Decimal(text) * 1_000_000
    except InvalidOperation:
        raise argparse.ArgumentTypeError(
            f"not a price: {text!r} (USD per million tokens)"
        ) from None
    if micros < 0 or micros != micros.to_integral_value():
        raise argparse.ArgumentTypeError(f"price {text!r} must be >= 0 with at most 6 decimals")
    return int(micros)


def _share(text: str) -> float | None:
    """A share of the retained budget in [0, 1], or 'default' (None: the replica's)."""
    if text.strip().lower() == "default":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a share: {text!r} (0 to 1, or 'default')") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"share {text!r} must be within 0 and 1")
    return value


def _mult(text: str) -> str:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not a multiplier: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("multipliers must be >= 0")
    return str(value)


# ------------------------------------------------------------------ commands


def cmd_orgs_create(s: Session, a: argparse.Namespace) -> None:
    org = create_org(s, a.name)
    s.commit()
    _say(org.id if a.quiet else f"created org {org.name} ({org.id})")


def cmd_orgs_list(s: Session, a: argparse.Namespace) -> None:
    t = _table("id", "name", "global scope", "allow-list", "retained share", "created")
    for org in s.scalars(select(Org).order_by(Org.created_at)):
        n = len([d for d in org.global_allowlist.split("\n") if d])
        _add_row(
            t,
            org.id,
            org.name,
            "allowed" if org.allow_global_scope else "off",
            str(n) if n else "any",
            "default" if org.retained_share is None else f"{org.retained_share:g}",
            _minute(org.created_at),
        )
    out.print(t)


def cmd_orgs_set_policy(s: Session, a: argparse.Namespace) -> None:
    org = get_org(s, a.name)
    set_policy(s, org, allow_global=a.allow_global_scope, allowlist=a.allow_prefix)
    s.commit()
    state = "allowed" if org.allow_global_scope else "off"
    _say(f"org {org.name}: global scope {state}")


def cmd_orgs_set_retention(s: Session, a: argparse.Namespace) -> None:
    org = get_org(s, a.name)
    org.retained_share = a.share
    s.commit()
    share = "the replicas' default" if a.share is None else f"{a.share:g}"
    _say(f"org {org.name}: retained share {share}")


def cmd_workspaces_create(s: Session, a: argparse.Namespace) -> None:
    ws = create_workspace(s, get_org(s, a.org), a.name)
    s.commit()
    _say(ws.id if a.quiet else f"created workspace {ws.name} ({ws.id})")


def cmd_workspaces_list(s: Session, a: argparse.Namespace) -> None:
    org = get_org(s, a.org)
    t = _table("id", "name", "created")
    for ws in s.scalars(select(Workspace).where(Workspace.org_id == org.id)):
        _add_row(t, ws.id, ws.name, _minute(ws.created_at))
    out.print(t)


def cmd_keys_create(s: Session, a: argparse.Namespace) -> None:
    org = get_org(s, a.org)
    ws = get_workspace(s, org, a.workspace) if a.workspace else None
    key, raw = create_key(s, org, name=a.name or "", workspace=ws, admin=a.admin)
    s.commit()
    if a.quiet:
        print(raw)
        return
    kind = "admin key" if a.admin else "API key"
    _say(f"created {kind} {key.id} for {org.name}")
    out.print(f"[bold]{raw}[/bold]")
    out.print("Store it now: it is not shown again.")


def cmd_keys_list(s: Session, a: argparse.Namespace) -> None:
    org = get_org(s, a.org)
    t = _table("id", "name", "kind", "workspace", "ends with", "state")
    for k in s.scalars(select(ApiKey).where(ApiKey.org_id == org.id).order_by(ApiKey.created_at)):
        _add_row(
            t,
            k.id,
            k.name,
            "admin" if k.is_admin else "api",
            k.workspace_id or "-",
            k.hint,
            "revoked" if k.revoked_at else "active",
        )
    out.print(t)


def cmd_keys_revoke(s: Session, a: argparse.Namespace) -> None:
    key = revoke_key(s, a.key_id)
    s.commit()
    _say(f"revoked {key.id}")


def _upsert_price(s: Session, model: str, p: dict[str, Any]) -> None:
    row = s.get(ModelPrice, model) or ModelPrice(model=model)
    row.input_per_mtok = p["input"]
    row.output_per_mtok = p["output"]
    row.write_5m_mult = p.get("write_5m", "1.25")
    row.write_1h_mult = p.get("write_1h", "2")
    row.read_mult = p.get("read", "0.1")
    s.add(row)


def cmd_prices_set(s: Session, a: argparse.Namespace) -> None:
    _upsert_price(
        s,
        a.model,
        {
            "input": a.input,
            "output": a.output,
            "write_5m": a.write_5m,
            "write_1h": a.write_1h,
            "read": a.read,
        },
    )
    s.commit()
    _say(f"price set for {a.model}")


def cmd_prices_load(s: Session, a: argparse.Namespace) -> None:
    """JSON: {"model": {"input": "3", "output": "15", "write_5m": "1.25", ...}} in USD/MTok."""
    try:
        data = json.loads(Path(a.file).read_text())
        if not isinstance(data, dict):
            raise ValueError("top level must be an object of models")
        for model, p in data.items():
            _upsert_price(
                s,
                model,
                {
                    "input": _usd_per_mtok(str(p["input"])),
                    "output": _usd_per_mtok(str(p["output"])),
                    "write_5m": _mult(str(p.get("write_5m", "1.25"))),
                    "write_1h": _mult(str(p.get("write_1h", "2"))),
                    "read": _mult(str(p.get("read", "0.1"))),
                },
            )
    except (OSError, ValueError, KeyError, TypeError, argparse.ArgumentTypeError) as exc:
        raise TenantError(f"cannot load prices from {a.file}: {exc}") from exc
    s.commit()
    out.print(f"loaded {len(data)} price(s)")


def cmd_prices_list(s: Session, a: argparse.Namespace) -> None:
    t = _table("model", "input $/MTok", "output $/MTok", "write 5m", "write 1h", "read")
    for p in s.scalars(select(ModelPrice).order_by(ModelPrice.model)):
        _add_row(
            t,
            p.model,
            str(Decimal(p.input_per_mtok) / 1_000_000),
            str(Decimal(p.output_per_mtok) / 1_000_000),
            p.write_5m_mult,
            p.write_1h_mult,
            p.read_mult,
        )
    out.print(t)


def _gateway_settings() -> GatewaySettings | None:
    """The gateway's settings as this environment gives them (aliases, default prices);
    None when the environment does not make valid gateway settings."""
    try:
        return GatewaySettings()
    except ValueError:
        return None


def cmd_models_alias(s: Session, a: argparse.Namespace) -> None:
    try:
        name, target = aliases.check_alias(a.alias), aliases.check_target(a.model)
    except ValueError as exc:
        raise TenantError(str(exc)) from None
    row = s.get(ModelAlias, name) or ModelAlias(alias=name)
    row.model = target
    s.add(row)
    s.commit()
    _say(
        f"alias {name} -> {target}; gateways pick it up within auth_cache_seconds (5 s by default)"
    )


def cmd_models_unalias(s: Session, a: argparse.Namespace) -> None:
    row = s.get(ModelAlias, a.alias)
    if row is None:
        gs = _gateway_settings()
        where = (
            " (it comes from the gateway's model_aliases setting: change it there)"
            if gs is not None and a.alias in gs.model_aliases
            else ""
        )
        raise TenantError(f"no alias {a.alias!r} in the database{where}")
    s.delete(row)
    s.commit()
    _say(f"removed alias {a.alias}")


def cmd_models_list(s: Session, a: argparse.Namespace) -> None:
    gs = _gateway_settings()
    table = {k: (v, "settings") for k, v in (gs.model_aliases if gs else {}).items()}
    table.update({k: (v, "database") for k, v in aliases.load(s).items()})
    t = _table("alias", "served model", "kind", "source")
    for name in sorted(table, key=lambda n: (n == "*", n.endswith("*"), n)):
        kind = "default" if name == "*" else "prefix" if name.endswith("*") else "name"
        _add_row(t, name, table[name][0], kind, table[name][1])
    out.print(t)
    if gs is not None:
        _say(f"served models (gateway settings): {', '.join(gs.models)}")


def _since(text: str) -> str:
    """'7d', '24h', '30m' ago, or an RFC 3339 timestamp."""
    units = {"d": "days", "h": "hours", "m": "minutes"}
    # NOTE: isascii too: str.isdigit() is true of "²", which int() refuses.
    if text[:-1].isascii() and text[:-1].isdigit() and text[-1] in units:
        try:
            t = datetime.now(UTC) - timedelta(**{units[text[-1]]: int(text[:-1])})
        except OverflowError:
            raise TenantError(f"--since: {text!r} reaches back before year 1") from None
        return t.isoformat()
    return text


def cmd_usage(s: Session, a: argparse.Namespace) -> None:
    org = get_org(s, a.org)
    since = _since(a.since)
    limit = a.limit
    if limit is None and not a.until:
        # Show every bucket from --since up to the one holding now, within the page cap.
        try:
            start = parse_time("--since", since)
        except ReportError as exc:
            raise TenantError(f"{exc} (or a duration: 7d, 24h, 30m)") from None
        width = WIDTHS[a.bucket]
        span = (datetime.now(UTC) - start).total_seconds()
        # NOTE: at least 1: a --since in the future is the "ending_at" error, not "limit".
        limit = max(1, min(int(span // width) + 2, LIMITS[a.bucket][1]))
    params = [("starting_at", since), ("bucket_width", a.bucket)]
    params += [("limit", str(limit))] if limit else []
    params += [("ending_at", a.until)] if a.until else []
    groups = list(dict.fromkeys(_GROUP_NAMES.get(g, g) for g in a.group_by or []))
    params += [("group_by", g) for g in groups]
    params += [("session_ids", v) for v in a.session_id or []]
    params += [("user_ids", v) for v in a.user_id or []]
    try:
        q = parse_query(org.id, params, USAGE_GROUPS, WIDTHS)
    except ReportError as exc:
        raise TenantError(str(exc)) from exc
    price_of = _prices(s)
    cols = [
        "starting_at",
        *groups,
        "uncached_input",
        "cache_read",
        "cache_write_5m",
        "cache_write_1h",
        "output",
        "cost_usd",
        "uncached_usd",
        "saved_usd",
    ]
    # NOTE: the first 1 + len(groups) cells are text (a tenant's user_id among them);
    # the rest are numbers this command writes, which CSV must keep as numbers.
    texts = 1 + len(groups)
    rows = [
        [
            r.starting_at,
            *(str(r.group[g]) for g in groups),
            *(r.tokens[f] for f in TOKEN_FIELDS),
            usd(r.cost_micros),
            usd(r.uncached_micros),
            usd(r.saved_micros),
        ]
        for r in spend(s, q, price_of, total=a.total)
    ]
    if a.csv:
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows([*(csv_text(str(c)) for c in row[:texts]), *row[texts:]] for row in rows)
        return
    t = _table(*cols, title=f"usage of {org.name}")
    for row in rows:
        _add_row(t, *row)
    out.print(t)
    starts = (q.end - q.start).total_seconds() // WIDTHS[q.width]
    if starts > q.limit:
        out.print("more buckets follow: narrow --since or raise --limit")


def cmd_sessions(s: Session, a: argparse.Namespace) -> None:
    org = get_org(s, a.org)
    rows = (
        s.execute(
            select(UsageRecord)
            .where(UsageRecord.org_id == org.id, UsageRecord.session_id == a.session_id)
            .order_by(UsageRecord.created_at, UsageRecord.request_id)
        )
        .scalars()
        .all()
    )
    if not rows:
        raise TenantError(f"no billed requests of session {a.session_id!r} in org {org.name!r}")
    price_of = _prices(s)
    session_turns = turns(rows, price_of)
    if a.png is not None:
        try:
            draw(session_turns, a.png, f"session {a.session_id} of {org.name}")
        except (PictureError, OSError) as exc:
            raise TenantError(f"--png {a.png}: {exc}") from None
        _say(f"wrote {a.png}", err)  # on stderr: stdout may be --csv
    cols = [
        "turn",
        "request",
        "model",
        "uncached_input",
        "cache_read",
        "cache_write_5m",
        "cache_write_1h",
        "output",
        "appended",
        "cost_usd",
        "uncached_usd",
        "break",
    ]
    table_rows = [
        [
            t.index,
            t.request_id,
            t.model,
            t.buckets.input_tokens,
            t.buckets.cache_read_input_tokens,
            t.buckets.cache_write_5m_tokens,
            t.buckets.cache_write_1h_tokens,
            t.buckets.output_tokens,
            t.appended,
            usd(t.cost_micros),
            usd(t.uncached_micros),
            _break(t),
        ]
        for t in session_turns
    ]
    if a.csv:
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows([row[0], *(csv_text(str(c)) for c in row[1:3]), *row[3:]] for row in table_rows)
        return
    t = _table(*cols, title=f"session {a.session_id} of {org.name}")
    for row in table_rows:
        _add_row(t, *row)
    out.print(t)
    cost = sum(x.cost_micros for x in session_turns)
    uncached = sum(x.uncached_micros for x in session_turns)
    broken = [x for x in session_turns if x.broke]
    lost = sum(x.break_micros for x in broken)
    n = len(session_turns)
    _say(
        f"{n} turn{'' if n == 1 else 's'}: ${usd(cost)} against ${usd(uncached)} uncached; "
        f"{len(broken)} broke the cache (wrote what a turn before had cached), costing "
        f"${usd(lost)} over reading it"
    )


def _break(t: Turn) -> str:
    """The break column: why a turn wrote more than it appended, and what it cost."""
    if not t.broke:
        return ""
    if t.reason is None:
        return "not diagnosed (no session or opt-in on the turn)"
    if t.reason == NO_DIVERGENCE:
        # NOTE: billed before the server's outcome reasons existed (gateway/diagnostics.py):
        # the prompt only appended, so the turn before was not in the cache any more.
        return "prompt unchanged: the entry was gone (expired or evicted)"
    tokens = f"; {t.missed} tokens ${usd(t.break_micros)}" if t.missed else ""
    detail = f" ({t.detail})" if t.detail else ""
    return f"{t.reason}{detail}{tokens}"


def _prices(s: Session) -> Callable[[str], Price]:
    """A model's price (its row, else the gateway's defaults), each read once."""
    default = _default_price()
    prices: dict[str, Price] = {}

    def price_of(model: str) -> Price:
        if model not in prices:
            prices[model] = price_for(s, model, default)
        return prices[model]

    return price_of


def _default_price() -> Price:
    gs = _gateway_settings()
    return Price(
        gs.default_input_per_mtok if gs else _DEFAULTS["default_input_per_mtok"],
        gs.default_output_per_mtok if gs else _DEFAULTS["default_output_per_mtok"],
    )


# NOTE: the short names the usage command takes for the ledger's columns.
_GROUP_NAMES = {
    "session": "session_id",
    "user": "user_id",
    "key": "api_key_id",
    "reason": "miss_reason",
}
_DEFAULTS = {
    name: GatewaySettings.model_fields[name].default
    for name in ("default_input_per_mtok", "default_output_per_mtok")
}


# -------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cachepoint-admin",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--db", default=DEFAULT_DB, help=f"database URL (default {DEFAULT_DB})")
    sub = p.add_subparsers(dest="group", metavar="GROUP", required=True)

    def command(parent: Any, name: str, fn: Callable[..., None], help: str) -> Any:
        c = parent.add_parser(name, help=help, description=help)
        c.set_defaults(fn=fn)
        return c

    orgs = sub.add_parser("orgs", help="organizations").add_subparsers(dest="cmd", required=True)
    c = command(orgs, "create", cmd_orgs_create, "create an org")
    c.add_argument("name")
    c.add_argument("--quiet", action="store_true", help="print only the new org id")
    command(orgs, "list", cmd_orgs_list, "list orgs")
    c = command(orgs, "set-policy", cmd_orgs_set_policy, "set an org's global-scope policy")
    c.add_argument("name")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--allow-global-scope", dest="allow_global_scope", action="store_true")
    g.add_argument("--deny-global-scope", dest="allow_global_scope", action="store_false")
    c.add_argument(
        "--allow-prefix",
        action="append",
        metavar="DIGEST",
        help="restrict global scope to these prefix digests (repeatable)",
    )

    c = command(
        orgs,
        "set-retention",
        cmd_orgs_set_retention,
        "set the share of each replica's retained (TTL) blocks an org may hold",
    )
    c.epilog = (
        "A replica may retain retained_share x its blocks under TTL; each org may hold "
        "SHARE of that (the replica's org_retained_share, 0.5 by default, when unset). "
        "A cache write past the quota is refused and billed as plain input. Lowering a "
        "share never drops retention already granted; it applies to new writes. Gateways "
        "pick the change up within auth_cache_seconds (5 s by default)."
    )
    c.add_argument("name", help="org name or id")
    c.add_argument(
        "--share",
        required=True,
        type=_share,
        help="0 to 1 (1 = no per-org limit, 0 = no retention), or 'default'",
    )

    ws = sub.add_parser("workspaces", help="workspaces").add_subparsers(dest="cmd", required=True)
    c = command(ws, "create", cmd_workspaces_create, "create a workspace in an org")
    c.add_argument("--org", required=True)
    c.add_argument("name")
    c.add_argument("--quiet", action="store_true", help="print only the new workspace id")
    c = command(ws, "list", cmd_workspaces_list, "list an org's workspaces")
    c.add_argument("--org", required=True)

    keys = sub.add_parser("keys", help="API and admin keys").add_subparsers(
        dest="cmd", required=True
    )
    c = command(keys, "create", cmd_keys_create, "issue a key (shown once)")
    c.add_argument("--org", required=True)
    c.add_argument("--workspace", help="workspace name or id")
    c.add_argument("--name", help="a label for the key")
    c.add_argument("--admin", action="store_true", help="an admin key (reports, no messages)")
    c.add_argument("--quiet", action="store_true", help="print only the key")
    c = command(keys, "list", cmd_keys_list, "list an org's keys")
    c.add_argument("--org", required=True)
    c = command(keys, "revoke", cmd_keys_revoke, "revoke a key by id")
    c.add_argument("key_id")

    prices = sub.add_parser("prices", help="model prices").add_subparsers(dest="cmd", required=True)
    c = command(prices, "set", cmd_prices_set, "set one model's prices (USD per MTok)")
    c.add_argument("model")
    c.add_argument("--input", required=True, type=_usd_per_mtok, help="USD per MTok input")
    c.add_argument("--output", required=True, type=_usd_per_mtok, help="USD per MTok output")
    c.add_argument("--write-5m", default="1.25", type=_mult, help="5m write multiplier")
    c.add_argument("--write-1h", default="2", type=_mult, help="1h write multiplier")
    c.add_argument("--read", default="0.1", type=_mult, help="cache read multiplier")
    c = command(prices, "load", cmd_prices_load, "load prices from a JSON file")
    c.add_argument("file")
    command(prices, "list", cmd_prices_list, "list prices")

    models = sub.add_parser("models", help="model aliases").add_subparsers(
        dest="cmd", required=True
    )
    c = command(
        models,
        "alias",
        cmd_models_alias,
        "let clients name a served model by another name (e.g. Claude Code's claude-sonnet-4-5)",
    )
    c.epilog = (
        "ALIAS may end in '*' (a prefix pattern, e.g. 'claude-*'); '*' alone is the "
        "default for any name no served model or other alias matches. Exact beats the "
        "longest prefix beats '*'. These override the gateway's model_aliases setting "
        "for the same name, and gateways pick them up within auth_cache_seconds."
    )
    c.add_argument("alias", help="the name clients send, or a 'prefix*' / '*' pattern")
    c.add_argument("model", help="the served model id it resolves to")
    c = command(models, "unalias", cmd_models_unalias, "remove an alias from the database")
    c.add_argument("alias")
    command(models, "list", cmd_models_list, "list aliases (database and this env's settings)")

    c = command(
        sub,
        "usage",
        cmd_usage,
        "print an org's usage by time bucket: the four buckets, cost and what the cache saved",
    )
    c.epilog = (
        "What a developer's Claude Code session cost and what the cache saved: "
        "cachepoint-admin usage --org ORG --session-id SESSION --total"
    )
    c.add_argument("--org", required=True)
    c.add_argument("--since", default="7d", help="7d, 24h, 30m ago, or RFC 3339 (default 7d)")
    c.add_argument("--until", help="RFC 3339 end (default: now)")
    c.add_argument("--bucket", default="1d", choices=sorted(WIDTHS), help="bucket width")
    c.add_argument(
        "--group-by",
        action="append",
        choices=sorted(USAGE_GROUPS | set(_GROUP_NAMES)),
        help="repeatable; session = X-Claude-Code-Session-Id, user = metadata.user_id, "
        "api = messages, chat.completions or completions",
    )
    c.add_argument("--session-id", action="append", help="only these sessions (repeatable)")
    c.add_argument("--user-id", action="append", help="only these metadata.user_id values")
    c.add_argument("--total", action="store_true", help="one row per group for the whole window")
    c.add_argument("--limit", type=int, help="buckets to show")
    c.add_argument("--csv", action="store_true", help="CSV on stdout instead of a table")

    c = command(
        sub,
        "sessions",
        cmd_sessions,
        "print one session turn by turn: the four buckets, cost against uncached, and "
        "why each turn that wrote more than it appended broke the cache",
    )
    c.epilog = (
        "A session is Claude Code's X-Claude-Code-Session-Id (or the session in "
        "metadata.user_id). Its turns are compared with the turn each continues (cache "
        "diagnostics), so a break names its cause: a prompt change (tools_changed, "
        "system_changed, messages_changed, model_changed, unavailable: another prompt "
        "parameter, scope_changed, betas_changed) or what happened to the entry "
        "(not_retained, routed_elsewhere, replica_restarted, entry_expired, "
        "entry_evicted, below_minimum)."
    )
    c.add_argument("session_id", metavar="SESSION_ID")
    c.add_argument("--org", required=True)
    c.add_argument("--csv", action="store_true", help="CSV on stdout instead of a table")
    c.add_argument(
        "--png",
        type=Path,
        metavar="FILE",
        help="also draw the session's reads and writes per turn, breaks marked, as a PNG "
        "(needs matplotlib)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        engine = make_engine(args.db)
        upgrade(engine)
    except OperationalError as exc:
        _say(f"cachepoint-admin: cannot open database {args.db}: {exc.orig}", err)
        return 2
    try:
        with make_sessionmaker(engine)() as session:
            args.fn(session, args)
    except TenantError as exc:
        _say(f"cachepoint-admin: {exc}", err)
        return 1
    finally:
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
