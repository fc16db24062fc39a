"""Sessions in billing: ledger rows carry Claude Code's session id and
metadata.user_id; reports filter and group by them with the four buckets, the cost
and what the cache saved; migration 0004 on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from alembic import command
from alembic.config import Config
from sqlalchemy import inspect, text

from cachepoint.billing import Price, buckets, cost_micros, uncached_cost_micros
from cachepoint.gateway.admin.cli import main as admin
from cachepoint.gateway.billing.ledger import Attribution, Charge, record
from cachepoint.gateway.billing.reports import (
    USAGE_GROUPS,
    WIDTHS,
    parse_query,
    spend,
    usage_report,
)
from cachepoint.gateway.db.migrate import MIGRATIONS, upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import create_org

PRICE = Price(3_000_000, 15_000_000)  # $3 / $15 per MTok: 3 and 15 micro-dollars a token
T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


def usd(micros: int) -> str:
    return f"{Decimal(micros) / 1_000_000:.6f}"


# (session, user, prompt, read, write_5m, output): a three-turn session that reads its
# prefix back, and one uncached request of another user.
TURNS = [
    ("s1", "u1", 2000, 0, 1600, 20),
    ("s1", "u1", 2100, 1600, 400, 30),
    ("s1", "u1", 2200, 2000, 100, 40),
    ("s2", "u2", 500, 0, 0, 10),
]


def _seed(session) -> str:
    org = create_org(session, "acme")
    other = create_org(session, "other")
    session.commit()
    for i, (sid, uid, n, read, w5, out) in enumerate(TURNS):
        b = buckets(n, read, w5, 0, out)
        who = Attribution(session_id=sid, user_id=uid, requested_model="claude-sonnet-4-5")
        charge = Charge(f"r{i}", org.id, None, "k1", "m", "r0", "org", b, who)
        assert record(session, charge, PRICE, T0 + timedelta(minutes=i))
    # Another org's row with the same session id never shows up in acme's report.
    b = buckets(999, 0, 0, 0, 9)
    record(
        session, Charge("x", other.id, None, "k2", "m", "r0", "org", b, Attribution("s1")), PRICE
    )
    return org.id


def _query(org: str, **params):
    items = [("starting_at", T0.isoformat()), ("ending_at", (T0 + timedelta(hours=1)).isoformat())]
    items.append(("bucket_width", "1h"))
    for k, v in params.items():
        items += [(k, x) for x in (v if isinstance(v, list) else [v])]
    return parse_query(org, items, USAGE_GROUPS, WIDTHS)


def _expected(sid: str) -> tuple[list[int], int, int]:
    tokens = [0] * 5
    cost = uncached = 0
    for s, _, n, read, w5, out in TURNS:
        if s != sid:
            continue
        b = buckets(n, read, w5, 0, out)
        for j, v in enumerate((b.input_tokens, read, w5, 0, out)):
            tokens[j] += v
        cost += cost_micros(b, PRICE)
        uncached += uncached_cost_micros(b, PRICE)
    return tokens, cost, uncached


def test_ledger_rows_group_and_filter_by_session_and_user(session):
    org = _seed(session)
    rows = spend(session, _query(org, group_by="session_id"), lambda m: PRICE, total=True)
    got = {r.group["session_id"]: r for r in rows}
    assert set(got) == {"s1", "s2"}
    for sid, r in got.items():
        tokens, cost, uncached = _expected(sid)
        assert list(r.tokens.values()) == tokens
        assert r.cost_micros == cost
        assert r.uncached_micros == uncached
        assert r.saved_micros == uncached - cost
    # s1 read most of its prompt: it saved; s2 cached nothing: it saved nothing.
    assert got["s1"].saved_micros > 0
    assert got["s2"].saved_micros == 0
    # Hand-checked: s1 is 6300 prompt tokens + 90 output uncached = 20250 µ$.
    assert got["s1"].uncached_micros == 6300 * 3 + 90 * 15
    by_user = spend(session, _query(org, group_by="user_id", user_ids="u2"), lambda m: PRICE)
    assert [(r.group, r.tokens["input_tokens"]) for r in by_user] == [({"user_id": "u2"}, 500)]
    # The Admin-API-shaped report takes the same filter and group.
    report = usage_report(session, _query(org, session_ids="s1", **{"group_by[]": "session_id"}))
    (item,) = report["data"][0]["results"]
    assert item["session_id"] == "s1"
    assert item["cache_read_input_tokens"] == 3600
    assert item["output_tokens"] == 90
    assert item["model"] is None and "user_id" not in item


def test_usage_command_answers_what_a_session_cost_and_saved(tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/ledger.db"
    engine = make_engine(db)
    upgrade(engine)
    with make_sessionmaker(engine)() as s:
        _seed(s)
    engine.dispose()
    assert admin(["--db", db, "prices", "set", "m", "--input", "3", "--output", "15"]) == 0
    capsys.readouterr()
    since = T0.isoformat()
    until = (T0 + timedelta(days=1)).isoformat()
    argv = ["--db", db, "usage", "--org", "acme", "--since", since, "--until", until]
    assert admin([*argv, "--bucket", "1h", "--session-id", "s1", "--total", "--csv"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header == (
        "starting_at,uncached_input,cache_read,cache_write_5m,cache_write_1h,output,"
        "cost_usd,uncached_usd,saved_usd"
    )
    tokens, cost, uncached = _expected("s1")
    fields = row.split(",")
    assert [int(x) for x in fields[1:6]] == tokens
    assert fields[6:] == [
        f"{cost / 1e6:.6f}",
        f"{uncached / 1e6:.6f}",
        f"{(uncached - cost) / 1e6:.6f}",
    ]
    assert admin([*argv, "--bucket", "1h", "--group-by", "user", "--total", "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("starting_at,user_id,")
    assert sorted(line.split(",")[1] for line in lines[1:]) == ["u1", "u2"]
    # The table form, as a person runs it.
    assert admin([*argv, "--bucket", "1h", "--group-by", "session", "--total"]) == 0
    assert "saved_usd" in capsys.readouterr().out


def _alembic(conn, rev: str, down: bool = False) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = conn
    (command.downgrade if down else command.upgrade)(cfg, rev)


def test_migration_0004_upgrades_keeps_rows_and_downgrades(db_url):
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            _alembic(conn, "0003")
            conn.execute(
                text(
                    "INSERT INTO usage (request_id, org_id, api_key_id, model, replica, scope,"
                    " input_tokens, cache_read_input_tokens, cache_write_5m_tokens,"
                    " cache_write_1h_tokens, output_tokens, cost_micros, created_at, created_s)"
                    " VALUES ('old', 'o', 'k', 'm', 'r', 'org', 1, 0, 0, 0, 1, 18, :t, 0)"
                ),
                {"t": T0},
            )
        with engine.begin() as conn:
            _alembic(conn, "head")
        insp = inspect(engine)
        cols = {c["name"] for c in insp.get_columns("usage")}
        assert {"session_id", "user_id", "requested_model"} <= cols
        assert "model_aliases" in insp.get_table_names()
        assert "ix_usage_org_session" in {i["name"] for i in insp.get_indexes("usage")}
        with engine.connect() as conn:
            old = conn.execute(text("SELECT session_id, user_id FROM usage")).one()
        assert tuple(old) == (None, None)
        with engine.begin() as conn:
            _alembic(conn, "0003", down=True)
        insp = inspect(engine)
        assert "session_id" not in {c["name"] for c in insp.get_columns("usage")}
        assert "model_aliases" not in insp.get_table_names()
        with engine.begin() as conn:
            _alembic(conn, "head")
            assert conn.execute(text("SELECT count(*) FROM usage")).scalar() == 1
    finally:
        engine.dispose()
