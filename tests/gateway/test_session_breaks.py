"""`cachepoint-admin sessions` and `usage --group-by miss_reason`: a session's breaks,
their reasons and their cost, from ledger rows that carry cache diagnostics' reasons."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cachepoint.billing import Price, buckets
from cachepoint.gateway.admin.cli import main as admin
from cachepoint.gateway.admin.sessions import break_cost, turns
from cachepoint.gateway.billing.ledger import Attribution, Charge, record
from cachepoint.gateway.billing.reports import USAGE_GROUPS, WIDTHS, parse_query, spend
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.models import UsageRecord
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import create_org

PRICE = Price(3_000_000, 15_000_000)
T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)

# (prompt, read, write_5m, output, miss_reason, miss_tokens): a session whose third turn
# had its system text changed (it wrote its whole prompt again) and whose fifth came
# after its entry expired (the prompt only appended, yet nothing was read).
SESSION = [
    (2000, 0, 2000, 20, None, None),
    (2100, 2000, 100, 20, "none", None),
    (2200, 0, 2200, 20, "system_changed", 2096),
    (2300, 2200, 100, 20, "none", None),
    (2400, 0, 2400, 20, "none", None),
]


def _seed(db: str) -> str:
    engine = make_engine(db)
    upgrade(engine)
    with make_sessionmaker(engine)() as s:
        org = create_org(s, "acme")
        s.commit()
        for i, (n, read, w5, out, reason, missed) in enumerate(SESSION):
            who = Attribution("s1", miss_reason=reason, miss_tokens=missed)
            b = buckets(n, read, w5, 0, out)
            charge = Charge(f"r{i}", org.id, None, "k1", "m", "r0", "org", b, who)
            assert record(s, charge, PRICE, T0 + timedelta(minutes=i))
        org_id = org.id
    engine.dispose()
    return org_id


def test_turns_mark_what_wrote_more_than_it_appended(tmp_path):
    db = f"sqlite:///{tmp_path}/l.db"
    _seed(db)
    engine = make_engine(db)
    with make_sessionmaker(engine)() as s:
        rows = s.query(UsageRecord).order_by(UsageRecord.created_at).all()
        got = turns(rows, lambda m: PRICE)
    engine.dispose()
    assert [t.broke for t in got] == [False, False, True, False, True]
    assert [t.appended for t in got] == [2000, 100, 100, 100, 100]
    third = got[2]
    assert (third.reason, third.missed) == ("system_changed", 2096)
    # 2096 tokens written at 1.25x instead of read at 0.1x: 1.15 x $3/MTok each.
    assert third.break_micros == round(2096 * 3 * 1.15) == break_cost(2096, third.buckets, PRICE)


def test_the_sessions_command_names_each_break_and_what_it_cost(tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/l.db"
    _seed(db)
    assert admin(["--db", db, "prices", "set", "m", "--input", "3", "--output", "15"]) == 0
    capsys.readouterr()
    assert admin(["--db", db, "sessions", "s1", "--org", "acme", "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(",")[-1] == "break"
    breaks = [line.rsplit(",", 1)[1] for line in lines[1:]]
    assert breaks == [
        "",
        "",
        f"system_changed; 2096 tokens ${2096 * 3 * 1.15 / 1e6:.6f}",
        "",
        "prompt unchanged: the entry was gone (expired or evicted)",
    ]
    assert admin(["--db", db, "sessions", "s1", "--org", "acme"]) == 0
    printed = capsys.readouterr().out
    assert "5 turns" in printed and "2 broke the cache" in printed
    assert admin(["--db", db, "sessions", "nope", "--org", "acme"]) == 1
    assert "no billed requests of session 'nope'" in capsys.readouterr().err


def test_usage_groups_by_miss_reason(tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/l.db"
    org = _seed(db)
    engine = make_engine(db)
    items = [("starting_at", T0.isoformat()), ("ending_at", (T0 + timedelta(hours=1)).isoformat())]
    items += [("bucket_width", "1h"), ("group_by", "miss_reason")]
    with make_sessionmaker(engine)() as s:
        rows = spend(s, parse_query(org, items, USAGE_GROUPS, WIDTHS), lambda m: PRICE, total=True)
    engine.dispose()
    writes = {r.group["miss_reason"]: r.tokens["cache_write_5m_tokens"] for r in rows}
    assert writes == {None: 2000, "none": 2600, "system_changed": 2200}
    since, until = T0.isoformat(), (T0 + timedelta(days=1)).isoformat()
    argv = ["--db", db, "usage", "--org", "acme", "--since", since, "--until", until]
    assert admin([*argv, "--group-by", "reason", "--total", "--csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("starting_at,miss_reason,")


def test_a_sessions_first_turn_breaks_only_when_it_continues_another_sessions(tmp_path):
    from cachepoint.gateway.db.models import UsageRecord as Row

    def row(reason, missed):
        return Row(
            request_id="r",
            model="m",
            input_tokens=10,
            cache_read_input_tokens=100,
            cache_write_5m_tokens=900,
            cache_write_1h_tokens=0,
            output_tokens=1,
            miss_reason=reason,
            miss_tokens=missed,
        )

    assert not turns([row(None, None)], lambda m: PRICE)[0].broke
    assert not turns([row("none", None)], lambda m: PRICE)[0].broke
    assert turns([row("system_changed", 800)], lambda m: PRICE)[0].broke
