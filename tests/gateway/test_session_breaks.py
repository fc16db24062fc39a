"""`cachepoint-admin sessions` and `usage --group-by miss_reason`: a session's breaks,
their reasons and their cost, from ledger rows that carry cache diagnostics' reasons."""

from __future__ import annotations

from dataclasses import replace
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
    (2500, 0, 2500, 20, "entry_evicted", 2400),
]
DETAILS = {5: "tier host"}  # the sixth turn's entry was evicted from the host tier


def _seed(db: str) -> str:
    engine = make_engine(db)
    upgrade(engine)
    with make_sessionmaker(engine)() as s:
        org = create_org(s, "acme")
        s.commit()
        for i, (n, read, w5, out, reason, missed) in enumerate(SESSION):
            who = Attribution("s1", miss_reason=reason, miss_tokens=missed)
            who = replace(who, miss_detail=DETAILS.get(i))
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
    assert [t.broke for t in got] == [False, False, True, False, True, True]
    assert [t.appended for t in got] == [2000, 100, 100, 100, 100, 100]
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
        f"entry_evicted (tier host); 2400 tokens ${2400 * 3 * 1.15 / 1e6:.6f}",
    ]
    assert admin(["--db", db, "sessions", "s1", "--org", "acme"]) == 0
    printed = capsys.readouterr().out
    assert "6 turns" in printed and "3 broke the cache" in printed
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
    assert writes == {None: 2000, "none": 2600, "system_changed": 2200, "entry_evicted": 2500}
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


def _red_runs(path) -> int:
    """Runs of the break colour along a row through the bars' lower part, where only the
    outlines of the turns that broke are red (two edges each)."""
    import matplotlib.image

    from cachepoint.gateway.admin.session_png import BREAK

    img = matplotlib.image.imread(path)[:, :, :3]
    row = img[int(img.shape[0] * 0.75)]
    want = [int(BREAK[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    red = (abs(row - want) < 0.08).all(axis=1).nonzero()[0].tolist()
    return sum(1 for a, b in zip([-10, *red], red, strict=False) if b - a > 1)


def test_the_sessions_picture_marks_the_breaks(tmp_path, capsys):
    db = f"sqlite:///{tmp_path}/l.db"
    _seed(db)
    png = tmp_path / "s1.png"
    assert admin(["--db", db, "sessions", "s1", "--org", "acme", "--csv", "--png", str(png)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].startswith("turn,")  # the CSV stays clean
    assert f"wrote {png}" in captured.err.replace("\n", "")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _red_runs(png) == 2 * 3  # three breaks (turns 3, 5 and 6), outlined in red
    # A session without breaks has no red at all.
    engine = make_engine(db)
    with make_sessionmaker(engine)() as s:
        rows = s.query(UsageRecord).order_by(UsageRecord.created_at).all()[:2]
        from cachepoint.gateway.admin.session_png import draw

        clean = draw(turns(rows, lambda m: PRICE), tmp_path / "clean.png", "two turns")
    engine.dispose()
    assert _red_runs(clean) == 0
    assert admin(["--db", db, "sessions", "s1", "--org", "acme", "--png", "/nope/x.png"]) == 1
    assert "--png /nope/x.png" in capsys.readouterr().err
