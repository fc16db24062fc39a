"""Model aliases: Claude Code's own model names served by a Cachepoint model,
from settings and from the database (`cachepoint-admin models alias`), and listed in
/v1/models in Anthropic's shape."""

from __future__ import annotations

import time

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import text

from cachepoint.gateway.admin.cli import main as admin
from cachepoint.gateway.db.session import make_engine
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.aliases import check_alias, concrete, match

from .scripted import MODEL, Script, gateway_factory

SESSION = "3f1c7a52-9a1e-4f0a-8a52-2f4d2a1b9c00"
USER = '{"device_id":"d3adb33f","account_uuid":"","session_id":"' + SESSION + '"}'


@pytest.fixture
def gateway_for(serve, tmp_path):
    return gateway_factory(serve, tmp_path)


def _ask(url: str, key: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    body.update(extra.pop("body", {}))
    return httpx.post(
        f"{url}/v1/messages",
        json=body,
        headers={"x-api-key": key, "anthropic-version": "2023-06-01", **extra},
        timeout=30,
    )


def _ledger(db: str) -> list[dict]:
    engine = make_engine(db)
    try:
        with engine.connect() as conn:
            q = "SELECT model, requested_model, session_id, user_id FROM usage ORDER BY created_s"
            return [dict(r._mapping) for r in conn.execute(text(q))]
    finally:
        engine.dispose()


def test_match_exact_beats_longest_prefix_beats_default():
    table = {
        "claude-sonnet-4-5": "exact",
        "claude-*": "short",
        "claude-sonnet-*": "long",
        "*": "default",
    }
    assert match(table, "claude-sonnet-4-5") == "exact"
    assert match(table, "claude-sonnet-4-5-20250929") == "long"
    assert match(table, "claude-opus-4-1") == "short"
    assert match(table, "gpt-4o") == "default"
    assert match({"claude-*": "x"}, "gpt-4o") is None
    assert match({}, "claude-sonnet-4-5") is None
    # A pattern matches its own prefix too ("claude-" + "").
    assert match({"claude-*": "x"}, "claude-") == "x"
    assert concrete(table) == {"claude-sonnet-4-5": "exact"}


@pytest.mark.parametrize("bad", ["", "a*b", "**", "cla*de-*", " claude", "tab\tname"])
def test_bad_alias_names_are_refused(bad):
    with pytest.raises(ValueError, match="alias"):
        check_alias(bad)
    with pytest.raises(ValidationError):
        GatewaySettings(model_aliases={bad: MODEL})


def test_settings_alias_targets_must_be_concrete():
    with pytest.raises(ValidationError, match="served model id"):
        GatewaySettings(model_aliases={"claude-*": "cachepoint-*"})


@pytest.mark.parametrize("stream", [False, True])
def test_claude_name_is_served_by_the_aliased_model_and_billed_with_session(gateway_for, stream):
    script = Script(texts=["ok"])
    gw = gateway_for(script, model_aliases={"claude-*": MODEL})
    extra = {"X-Claude-Code-Session-Id": SESSION}
    body = {"metadata": {"user_id": USER}, "stream": stream}
    r = _ask(gw.url, gw.keys["a"], "claude-sonnet-4-5-20250929", body=body, **extra)
    assert r.status_code == 200, r.text
    if stream:
        assert f'"model":"{MODEL}"' in r.text.replace(" ", "")
    else:
        # NOTE: like Anthropic answering an alias with the snapshot it resolved to.
        assert r.json()["model"] == MODEL
    (row,) = _wait(gw.db, 1)
    assert row == {
        "model": MODEL,
        "requested_model": "claude-sonnet-4-5-20250929",
        "session_id": SESSION,
        "user_id": USER,
    }
    assert script.calls == 1


def _wait(db: str, n: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.time() + timeout
    while len(rows := _ledger(db)) < n and time.time() < deadline:
        time.sleep(0.05)
    return rows


def test_a_served_name_is_itself_and_a_bad_session_header_is_ignored(gateway_for):
    gw = gateway_for(Script(), model_aliases={"*": "elsewhere"})
    r = _ask(gw.url, gw.keys["a"], MODEL, **{"X-Claude-Code-Session-Id": "s" * 129})
    assert r.status_code == 200, r.text
    (row,) = _wait(gw.db, 1)
    assert row == {"model": MODEL, "requested_model": None, "session_id": None, "user_id": None}


def test_unmatched_model_is_404_in_the_anthropic_envelope(gateway_for):
    gw = gateway_for(Script(), model_aliases={"claude-*": MODEL, "gpt-*": "not-served"})
    for model in ("mistral-large", "gpt-4o"):  # no alias; an alias to a model not served
        r = _ask(gw.url, gw.keys["a"], model)
        assert r.status_code == 404
        body = r.json()
        assert body["type"] == "error"
        assert body["error"] == {"type": "not_found_error", "message": f"model: {model}"}
        assert body["request_id"] == r.headers["request-id"]
        count = httpx.post(
            f"{gw.url}/v1/messages/count_tokens",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": gw.keys["a"]},
        )
        assert count.status_code == 404
        assert count.json()["error"]["type"] == "not_found_error"
    ok = httpx.post(
        f"{gw.url}/v1/messages/count_tokens",
        json={"model": "claude-haiku-4-5", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": gw.keys["a"]},
    )
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
    assert _ledger(gw.db) == []


def test_models_lists_named_aliases_not_patterns(gateway_for):
    gw = gateway_for(
        Script(),
        model_aliases={"claude-sonnet-4-5": MODEL, "claude-*": MODEL, "gone": "not-served"},
        model_profiles={MODEL: {"context_window": 4096}},
    )
    h = {"x-api-key": gw.keys["a"], "anthropic-version": "2023-06-01"}
    listing = httpx.get(f"{gw.url}/v1/models?beta=true", headers=h).json()
    ids = [m["id"] for m in listing["data"]]
    assert ids == [MODEL, "claude-sonnet-4-5"]
    alias = listing["data"][1]
    assert alias["type"] == "model"
    assert alias["display_name"] == f"claude-sonnet-4-5 (alias of {MODEL})"
    assert alias["max_input_tokens"] == 4096
    assert alias["max_tokens"] == 4095
    assert alias["created_at"]
    assert listing["first_id"] == MODEL and listing["last_id"] == "claude-sonnet-4-5"
    one = httpx.get(f"{gw.url}/v1/models/claude-sonnet-4-5", headers=h)
    assert one.status_code == 200 and one.json()["id"] == "claude-sonnet-4-5"
    # A name only a pattern matches resolves too, as a request with it would.
    assert httpx.get(f"{gw.url}/v1/models/claude-opus-4-1", headers=h).status_code == 200
    missing = httpx.get(f"{gw.url}/v1/models/gone", headers=h)
    assert missing.status_code == 404
    assert missing.json()["error"] == {"type": "not_found_error", "message": "model: gone"}
    bad_key = httpx.get(f"{gw.url}/v1/models", headers={"x-api-key": "nope"})
    assert bad_key.status_code == 401
    assert bad_key.json()["type"] == "error"
    assert bad_key.json()["error"]["type"] == "authentication_error"


def _until(predicate, timeout: float) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "not within the cache window"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_admin_cli_alias_takes_effect_within_the_cache_window(gateway_for, capsys):
    gw = gateway_for(
        Script(), auth_cache_seconds=1.0, model_aliases={"claude-opus-4-1": "not-served"}
    )
    key = gw.keys["a"]
    h = {"x-api-key": key}
    assert _ask(gw.url, key, "claude-opus-4-1").status_code == 404
    assert _ask(gw.url, key, "claude-haiku-4-5").status_code == 404
    # The database overrides the setting for the same name; a pattern covers the rest.
    assert admin(["--db", gw.db, "models", "alias", "claude-opus-4-1", MODEL]) == 0
    assert admin(["--db", gw.db, "models", "alias", "claude-*", MODEL]) == 0
    waited = _until(lambda: _ask(gw.url, key, "claude-opus-4-1").status_code == 200, 5.0)
    assert waited < 3.0
    assert _ask(gw.url, key, "claude-haiku-4-5").status_code == 200
    ids = [m["id"] for m in httpx.get(f"{gw.url}/v1/models", headers=h).json()["data"]]
    assert ids == [MODEL, "claude-opus-4-1"]
    capsys.readouterr()
    assert admin(["--db", gw.db, "models", "list"]) == 0
    listed = capsys.readouterr().out
    assert "claude-opus-4-1" in listed and "claude-*" in listed and "database" in listed
    assert admin(["--db", gw.db, "models", "unalias", "claude-*"]) == 0
    _until(lambda: _ask(gw.url, key, "claude-haiku-4-5").status_code == 404, 5.0)
    assert _ask(gw.url, key, "claude-opus-4-1").status_code == 200
    assert admin(["--db", gw.db, "models", "unalias", "claude-*"]) == 1
    assert admin(["--db", gw.db, "models", "alias", "a*b", MODEL]) == 1
    assert "'*' may only end a pattern" in capsys.readouterr().err
