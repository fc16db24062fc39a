"""`cachepoint-admin` as scripts use it: real processes, a real database file."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
import unicodedata
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import authenticate


def admin(db: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cachepoint.gateway.admin.cli", "--db", db, *args],
        capture_output=True,
        text=True,
        check=check,
    )


def test_admin_cli_orgs_keys_policy_prices(tmp_path):
    db = f"sqlite:///{tmp_path}/admin.db"
    assert "created org acme" in admin(db, "orgs", "create", "acme").stdout
    key = admin(db, "keys", "create", "--org", "acme", "--quiet").stdout.strip()
    admin_key = admin(db, "keys", "create", "--org", "acme", "--admin", "--quiet").stdout.strip()
    assert key.startswith("sk-cp-")
    assert "\n" not in key
    assert admin_key.startswith("sk-cp-admin-")
    admin(db, "orgs", "set-policy", "acme", "--allow-global-scope")
    admin(db, "prices", "set", "cachepoint-tiny", "--input", "3", "--output", "15")
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"big": {"input": "15", "output": "75", "write_1h": "2"}}))
    admin(db, "prices", "load", str(prices))
    listing = admin(db, "prices", "list").stdout
    assert "cachepoint-tiny" in listing
    assert "big" in listing

    engine = make_engine(db)
    with make_sessionmaker(engine)() as s:
        ctx = authenticate(s, key)
        assert ctx is not None
        assert ctx.policy.allow_global
        assert not ctx.is_admin
        assert authenticate(s, admin_key).is_admin
    keys = admin(db, "keys", "list", "--org", "acme").stdout
    key_id = next(word for word in keys.split() if word.startswith("apikey_"))
    assert "revoked" in admin(db, "keys", "revoke", key_id).stdout
    with make_sessionmaker(engine)() as s:
        assert authenticate(s, key) is None  # the first listed key is the API key
        assert authenticate(s, admin_key) is not None
    engine.dispose()


def test_admin_cli_errors_are_clear(tmp_path):
    db = f"sqlite:///{tmp_path}/admin.db"
    admin(db, "orgs", "create", "acme")
    dup = admin(db, "orgs", "create", "acme", check=False)
    assert dup.returncode == 1
    assert "already exists" in dup.stderr
    missing = admin(db, "keys", "create", "--org", "nope", check=False)
    assert missing.returncode == 1
    assert "no org named 'nope'" in missing.stderr
    bad_price = admin(db, "prices", "set", "m", "--input", "cheap", "--output", "1", check=False)
    assert bad_price.returncode == 2
    assert "not a price" in bad_price.stderr
    for r in (dup, missing, bad_price):
        assert "Traceback" not in r.stderr


def test_admin_cli_usage_table_and_csv(tmp_path, stack):
    import anthropic

    c = anthropic.Anthropic(base_url=stack["url"], api_key=stack["keys"]["a"], max_retries=0)
    c.messages.create(
        model="cachepoint-tiny", max_tokens=3, messages=[{"role": "user", "content": "count me"}]
    )
    out = admin(
        stack["db"],
        "usage",
        "--org",
        "a",
        "--since",
        "1d",
        "--bucket",
        "1h",
        "--group-by",
        "model",
        "--csv",
    ).stdout.splitlines()
    assert out[0] == (
        "starting_at,model,uncached_input,cache_read,cache_write_5m,cache_write_1h,output,"
        "cost_usd,uncached_usd,saved_usd"
    )
    rows = [line.split(",") for line in out[1:]]
    assert len(rows) == 1
    assert rows[0][1] == "cachepoint-tiny"
    assert int(rows[0][6]) >= 1
    table = admin(stack["db"], "usage", "--org", "a", "--since", "1d", "--bucket", "1h").stdout
    assert "usage of a" in table


def test_admin_cli_set_retention(tmp_path, capsys):
    """`orgs set-retention` stores the org's quota; the gateway
    reads it with the key and sends it to the replicas. In-process (the same `main`
    the script runs), so this stays fast."""
    from cachepoint.gateway.admin.cli import main

    db = f"sqlite:///{tmp_path}/admin.db"

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main(["--db", db, *args])
        except SystemExit as exc:  # argparse: --help, or a bad argument
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out, out.err

    assert run("orgs", "create", "acme")[0] == 0
    key = admin(db, "keys", "create", "--org", "acme", "--quiet").stdout.strip()
    code, out, _ = run("orgs", "set-retention", "acme", "--share", "0.25")
    assert code == 0
    assert "org acme: retained share 0.25" in out
    listing = run("orgs", "list")[1]
    assert "retained share" in listing
    assert "0.25" in listing

    def share() -> float | None:
        engine = make_engine(db)
        with make_sessionmaker(engine)() as s:
            ctx = authenticate(s, key)
        engine.dispose()
        assert ctx is not None
        return ctx.retained_share

    assert share() == 0.25
    assert run("orgs", "set-retention", "acme", "--share", "default")[0] == 0
    assert share() is None
    assert "default" in run("orgs", "list")[1]
    for bad, why in (("2", "must be within 0 and 1"), ("lots", "not a share")):
        code, _, err = run("orgs", "set-retention", "acme", "--share", bad)
        assert code == 2
        assert why in err
        assert "Traceback" not in err
    code, _, err = run("orgs", "set-retention", "nope", "--share", "0.5")
    assert code == 1
    assert "no org named 'nope'" in err
    assert share() is None  # nothing changed by the failures
    code, help_text, _ = run("orgs", "set-retention", "--help")
    assert code == 0
    assert "--share" in help_text
    assert "billed as plain input" in " ".join(help_text.split())


# ----------------------------------------------------------------------- untrusted text

HOSTILE_TERM = "\x1b[2J\x1b]0;title\x07"  # clear screen, set the window title
HOSTILE_CSV = '=HYPERLINK("http://x","y")'
PLAIN_USERS = ("alice", "José Ñúñez")
T_USAGE = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)


def _control_chars(text: str) -> list[str]:
    """C0 (bar the table's own newlines), DEL, C1 and the bidi controls in ``text``."""
    bidi = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}
    return [ch for ch in text if ch != "\n" and (unicodedata.category(ch) == "Cc" or ch in bidi)]


@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
    """`main` in process on a fresh database: cli(*args) -> (code, stdout, stderr).

    NOTE: stdout gets a wide console, so no cell is wrapped across lines and a cell's
    text can be looked for whole."""
    from rich.console import Console

    from cachepoint.gateway.admin import cli as module

    monkeypatch.setattr(module, "out", Console(width=1000))
    db = f"sqlite:///{tmp_path}/admin.db"

    def run(*args: str) -> tuple[int, str, str]:
        code = module.main(["--db", db, *args])
        got = capsys.readouterr()
        return code, got.out, got.err

    run.db = db  # type: ignore[attr-defined]
    return run


def _bill_users(
    db: str, org_name: str, users: tuple[str, ...], at: datetime = T_USAGE + timedelta(minutes=5)
) -> None:
    """One ledger row per user id, at ``at``, priced at 3/15 USD per MTok."""
    from cachepoint.billing import Price, buckets
    from cachepoint.gateway.billing.ledger import Attribution, Charge, record
    from cachepoint.gateway.tenancy.tenants import get_org

    engine = make_engine(db)
    with make_sessionmaker(engine)() as s:
        org = get_org(s, org_name)
        for i, user in enumerate(users):
            charge = Charge(
                f"req_{i}",
                org.id,
                None,
                "apikey_x",
                "cachepoint-tiny",
                "r0",
                "org",
                buckets(1000, 0, 0, 0, 10 + i),
                Attribution(user_id=user),
            )
            record(s, charge, Price(3_000_000, 15_000_000), at)
    engine.dispose()


def test_admin_cli_usage_escapes_tenant_user_ids(cli):
    """A tenant's metadata.user_id reaches neither the operator's terminal (escape
    sequences) nor a spreadsheet (formulas) as it is; ordinary ids are unchanged."""
    assert cli("orgs", "create", "acme")[0] == 0
    _bill_users(cli.db, "acme", (HOSTILE_TERM, HOSTILE_CSV, *PLAIN_USERS))
    # A price now zero makes the report's uncached figure 0 and the saving negative:
    # a number the CLI writes, which CSV must keep a number.
    assert cli("prices", "set", "cachepoint-tiny", "--input", "0", "--output", "0")[0] == 0
    window = ["--since", "2026-03-01T10:00:00Z", "--until", "2026-03-01T11:00:00Z"]
    args = ["usage", "--org", "acme", *window, "--bucket", "1h", "--group-by", "user"]

    code, table, err = cli(*args)
    assert code == 0, err
    assert _control_chars(table) == []
    assert "\\x1b[2J\\x1b]0;title\\x07" in table  # shown, as text
    assert HOSTILE_CSV in table  # a table is no spreadsheet: shown as it is
    for user in PLAIN_USERS:
        assert f" {user} " in table

    code, out, err = cli(*args, "--csv")
    assert code == 0, err
    assert _control_chars(out.replace("\r\n", "\n")) == []
    header, *rows = csv.reader(io.StringIO(out))
    assert header[:2] == ["starting_at", "user_id"]
    by_user = {row[1]: row for row in rows}
    assert set(by_user) == {
        "\\x1b[2J\\x1b]0;title\\x07",
        "'" + HOSTILE_CSV,
        *PLAIN_USERS,
    }
    for row in rows:
        assert row[0] == "2026-03-01T10:00:00Z"
        assert [int(n) for n in row[2:7]] == [1000, 0, 0, 0, int(row[6])]
        cost, uncached, saved = (Decimal(x) for x in row[7:10])
        assert uncached == 0
        assert saved == -cost < 0
        assert row[9].startswith("-")  # a negative number stays a number, unquoted


def test_admin_cli_tables_escape_names(cli):
    """Every table shows org, workspace, key and model names as plain escaped text: no
    escape sequence, no bidi reordering, no rich markup (an unbalanced closing tag
    raised MarkupError, a traceback)."""
    org = "evil\u202eorg"
    assert cli("orgs", "create", org)[0] == 0
    assert cli("workspaces", "create", "--org", org, "ws\x1b[31mred")[0] == 0
    assert cli("keys", "create", "--org", org, "--name", "[/b]key\x07", "--quiet")[0] == 0
    model = "[link=http://evil]m[/link]\x1b[0m"
    assert cli("prices", "set", model, "--input", "1", "--output", "2")[0] == 0
    assert cli("models", "alias", "[/b]", model)[0] == 0

    listings = {
        "orgs": cli("orgs", "list"),
        "workspaces": cli("workspaces", "list", "--org", org),
        "keys": cli("keys", "list", "--org", org),
        "prices": cli("prices", "list"),
        "models": cli("models", "list"),
    }
    for name, (code, table, err) in listings.items():
        assert code == 0, (name, err)
        assert "Traceback" not in err
        assert _control_chars(table) == [], name
    assert "evil\\u202eorg" in listings["orgs"][1]
    assert "ws\\x1b[31mred" in listings["workspaces"][1]
    assert "[/b]key\\x07" in listings["keys"][1]
    assert "[link=http://evil]m[/link]\\x1b[0m" in listings["prices"][1]
    assert "[/b]" in listings["models"][1]
    assert "[link=http://evil]m[/link]\\x1b[0m" in listings["models"][1]
    # The messages that echo a name are escaped too.
    code, said, _ = cli("orgs", "set-retention", org, "--share", "0.5")
    assert code == 0
    assert said.strip() == "org evil\\u202eorg: retained share 0.5"


def test_admin_cli_dates_have_four_digit_years(cli):
    """The usage table and CSV print year 1 as 0001 (RFC 3339), not "1";
    a --since that reaches before year 1 is a clear error, not a traceback."""
    assert cli("orgs", "create", "acme")[0] == 0
    year1 = datetime(1, 1, 1, tzinfo=UTC)
    _bill_users(cli.db, "acme", ("alice",), at=year1 + timedelta(hours=1, minutes=5))
    window = ["--since", "0001-01-01T00:00:00Z", "--until", "0001-01-02T00:00:00Z"]
    args = ["usage", "--org", "acme", *window, "--bucket", "1h"]
    code, out, err = cli(*args, "--csv")
    assert code == 0, err
    (row,) = list(csv.reader(io.StringIO(out)))[1:]
    assert row[0] == "0001-01-01T01:00:00Z"  # its own hour, in four-digit years
    assert int(row[5]) == 10
    code, table, err = cli(*args)
    assert code == 0, err
    assert " 0001-01-01T01:00:00Z " in table
    for since in ("9999999999d", "0001-01-01T00:00:00+01:00"):
        code, _, err = cli("usage", "--org", "acme", "--since", since)
        assert code == 1, since
        assert "--since" in err
        assert "Traceback" not in err
