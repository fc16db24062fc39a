"""`cachepoint-admin` as scripts use it: real processes, a real database file."""

from __future__ import annotations

import json
import subprocess
import sys

from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenants import authenticate


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
    """`orgs set-retention` stores the org's quota (issue 12, finding 4); the gateway
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
