"""Conformance and hardening: unknown betas as the docs say, 415
for a body that is not JSON or is compressed, no API docs unless asked for, and SSE
pings while a stream waits on its replica."""

from __future__ import annotations

import gzip
import itertools
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from cachepoint.replica.api.app import create_app as create_replica_app
from cachepoint.replica.settings import ReplicaSettings

from .scripted import MODEL, Gateway, Script, gateway_factory

DOCS = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"
ASK = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def gateway_for(serve, tmp_path):
    return gateway_factory(serve, tmp_path)


def _script(**kw: Any) -> Script:
    return Script(texts=["Hel", "lo"], once=True, stop_reason="end_turn", **kw)


def _post(
    gw: Gateway,
    path: str,
    content: bytes,
    headers: dict[str, str],
    key: str = "a",
) -> httpx.Response:
    return httpx.post(
        f"{gw.url}{path}",
        content=content,
        headers={"x-api-key": gw.keys[key], **headers},
        timeout=30,
    )


def _refused(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["request_id"] == r.headers["request-id"]
    return str(body["error"]["message"])


# ------------------------------------------------------------------------ betas


def _errors_paragraph() -> str:
    text = DOCS.read_text()
    start = text.index("Every response carries a `request-id` header")
    return text[start : text.index("\n## ", start)]


def test_unknown_betas_are_treated_as_the_docs_say(gateway_for):
    """The default accepts an unknown beta and names it in cachepoint-ignored-betas
    (Claude Code and the SDKs send betas on every request); the docs said it got
    `Unsupported beta header`, which only `strict_betas` does."""
    doc = _errors_paragraph()
    assert "cachepoint-ignored-betas" in doc and "strict_betas" in doc
    gw = gateway_for(_script())
    r = httpx.post(
        f"{gw.url}/v1/messages",
        json=ASK,
        headers={"x-api-key": gw.keys["a"], "anthropic-beta": "not-a-beta-2099-01-01"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.headers["cachepoint-ignored-betas"] == "not-a-beta-2099-01-01"
    strict = gateway_for(_script(), strict_betas=True)
    r = httpx.post(
        f"{strict.url}/v1/messages",
        json=ASK,
        headers={"x-api-key": strict.keys["a"], "anthropic-beta": "not-a-beta-2099-01-01"},
        timeout=30,
    )
    assert _refused(r, 400) == "Unsupported beta header: not-a-beta-2099-01-01"


# ---------------------------------------------------------------- media types


def test_a_body_that_is_not_json_gets_415_naming_its_type(gateway_for):
    script = _script()
    gw = gateway_for(script)
    raw = json.dumps(ASK).encode()
    count = json.dumps({"model": MODEL, "messages": ASK["messages"]}).encode()
    form = {"content-type": "application/x-www-form-urlencoded"}  # what `curl -d` sends
    for path, body in (("/v1/messages", raw), ("/v1/messages/count_tokens", count)):
        msg = _refused(_post(gw, path, body, form), 415)
        assert "application/x-www-form-urlencoded" in msg and "application/json" in msg
    msg = _refused(_post(gw, "/v1/messages", raw, {"content-type": "text/plain"}), 415)
    assert "text/plain" in msg
    # No content-type at all (raw bytes from a script): FastAPI would not parse it, and
    # the client got a 400 about a "dictionary".
    msg = _refused(_post(gw, "/v1/messages", raw, {}), 415)
    assert msg == "content-type is missing; send application/json"
    # The admin API's POST too (before its key is even looked at).
    r = _post(gw, "/v1/organizations/api_keys/nope", b'{"name":"x"}', form)
    assert "application/x-www-form-urlencoded" in _refused(r, 415)
    assert script.calls == 0 and not gw.rows()  # nothing was generated or billed


def test_json_media_types_are_read_as_json(gateway_for):
    gw = gateway_for(_script())
    raw = json.dumps(ASK).encode()
    for ctype in (
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/vnd.cachepoint+json",
    ):
        r = _post(gw, "/v1/messages", raw, {"content-type": ctype})
        assert r.status_code == 200, (ctype, r.text)
    assert r.json()["content"][0]["text"] == "Hello"
    r = _post(
        gw,
        "/v1/messages",
        raw,
        {"content-type": "application/json", "content-encoding": "identity"},
    )
    assert r.status_code == 200, r.text


def test_a_compressed_body_gets_415_and_is_never_inflated(gateway_for):
    script = _script()
    gw = gateway_for(script)
    # A gzip bomb: 64 MiB of JSON whitespace in about 64 KiB, far under the body cap.
    bomb = gzip.compress(b"{" + b" " * (64 * 2**20) + b"}", compresslevel=9)
    assert len(bomb) < 2**20
    for coding, body in (("gzip", bomb), ("br", b"x"), ("deflate, gzip", b"x")):
        r = _post(
            gw,
            "/v1/messages",
            body,
            {"content-type": "application/json", "content-encoding": coding},
        )
        msg = _refused(r, 415)
        assert coding in msg and "uncompressed" in msg
    assert script.calls == 0 and not gw.rows()
    # The gateway still serves.
    r = httpx.post(f"{gw.url}/v1/messages", json=ASK, headers={"x-api-key": gw.keys["a"]})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- API docs


DOC_PATHS = ("/docs", "/redoc", "/openapi.json")


def test_api_docs_are_off_by_default_on_the_gateway(gateway_for):
    gw = gateway_for(_script())
    for path in DOC_PATHS:
        r = httpx.get(f"{gw.url}{path}")
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["type"] == "not_found_error"
    on = gateway_for(_script(), api_docs=True)
    for path in DOC_PATHS:
        assert httpx.get(f"{on.url}{path}").status_code == 200, path
    assert "/v1/messages" in httpx.get(f"{on.url}/openapi.json").json()["paths"]


def test_api_docs_are_off_by_default_on_the_replica():
    # NOTE: no lifespan (TestClient outside `with`): the docs routes need no engine.
    for path in DOC_PATHS:
        off = TestClient(create_replica_app(ReplicaSettings()))
        assert off.get(path).status_code == 404, path
        on = TestClient(create_replica_app(ReplicaSettings(api_docs=True)))
        assert on.get(path).status_code == 200, path
    spec = TestClient(create_replica_app(ReplicaSettings(api_docs=True))).get("/openapi.json")
    assert "/v1/generate" in spec.json()["paths"]


def test_replica_api_docs_setting_comes_from_its_environment(monkeypatch):
    monkeypatch.setenv("CACHEPOINT_REPLICA_API_DOCS", "true")
    assert ReplicaSettings().api_docs is True
    monkeypatch.setenv("CACHEPOINT_GATEWAY_API_DOCS", "true")
    from cachepoint.gateway.settings import GatewaySettings

    assert GatewaySettings().api_docs is True


# ---------------------------------------------------------------------- pings


def _timed_events(r: httpx.Response) -> list[tuple[float, str, dict[str, Any]]]:
    """(arrival time, event name, data) of each SSE event of a streamed response."""
    out: list[tuple[float, str, dict[str, Any]]] = []
    buf = ""
    for text in r.iter_text():
        buf += text
        while "\n\n" in buf:
            raw, buf = buf.split("\n\n", 1)
            lines = dict(line.split(": ", 1) for line in raw.splitlines())
            out.append((time.monotonic(), lines["event"], json.loads(lines["data"])))
    return out


def test_a_stalled_stream_gets_pings_at_the_interval_and_then_completes(gateway_for):
    interval, stall = 0.2, 1.2
    gw = gateway_for(_script(delay_s=stall), sse_ping_interval_s=interval)
    headers = {"x-api-key": gw.keys["a"]}
    with httpx.stream(
        "POST", f"{gw.url}/v1/messages", json={**ASK, "stream": True}, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200
        events = _timed_events(r)
    names = [name for _, name, _ in events]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    assert all(data == {"type": "ping"} for _, name, data in events if name == "ping")
    # The relay's own ping right after the start, then pings while each token stalls.
    deltas = [i for i, n in enumerate(names) if n == "content_block_delta"]
    assert len(deltas) == 2
    before_first = names[: deltas[0]].count("ping") - 1
    between = names[deltas[0] : deltas[1]].count("ping")
    # NOTE: lower bounds with slack for a loaded machine; the exact count is ~stall/interval.
    assert before_first >= 2 and between >= 2, names
    # Never faster than the interval: consecutive pings with nothing between them.
    for (t0, a, _), (t1, b, _) in itertools.pairwise(events):
        if a == b == "ping":
            assert t1 - t0 >= interval * 0.8, (t1 - t0, names)
    text = "".join(d["delta"].get("text", "") for _, n, d in events if n == "content_block_delta")
    assert text == "Hello"
    assert events[-2][2]["usage"]["output_tokens"] == 2
    rows = gw.wait_rows(1)
    assert [row.output_tokens for row in rows] == [2]  # billed as delivered, once


def test_the_official_sdk_parses_a_stream_with_pings(gateway_for):
    gw = gateway_for(_script(delay_s=0.6), sse_ping_interval_s=0.1)
    client = gw.client()
    kinds: list[str] = []
    with client.messages.stream(**ASK) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == "Hello"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 2
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_a_fast_stream_has_only_the_first_ping_and_zero_turns_pings_off(gateway_for):
    for interval in (10.0, 0.0):
        gw = gateway_for(_script(delay_s=0.3), sse_ping_interval_s=interval)
        headers = {"x-api-key": gw.keys["a"]}
        r = httpx.post(f"{gw.url}/v1/messages", json={**ASK, "stream": True}, headers=headers)
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert names.count("ping") == 1, (interval, names)
        assert names[-1] == "message_stop"


def test_a_client_leaving_a_pinged_stream_is_billed_what_it_was_sent(gateway_for):
    script = Script(texts=["ab"], stop_reason="max_tokens", delay_s=0.3)
    gw = gateway_for(script, sse_ping_interval_s=0.05)
    headers = {"x-api-key": gw.keys["a"]}
    body = {**ASK, "max_tokens": 50, "stream": True}
    deltas = 0
    with httpx.stream("POST", f"{gw.url}/v1/messages", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if line == "event: content_block_delta":
                deltas += 1
                if deltas == 2:
                    break  # hang up mid-stream, between pings
    rows = gw.wait_rows(1)
    assert len(rows) == 1
    # The relay stops at once and bills what went out: the two deltas, at most one more
    # that was on its way when the connection closed.
    assert 2 <= rows[0].output_tokens <= 3, rows
    # The replica was told to stop: it writes no more lines and never finishes.
    (rid,) = script.sent
    time.sleep(0.4)
    stopped_at = script.sent[rid]
    time.sleep(0.8)
    assert script.sent[rid] == stopped_at < 50 and rid not in script.finished


# ------------------------------------------------------------ line separators in text

# NOTE: JSON leaves these unescaped, and str.splitlines (httpx's aiter_lines) breaks a
# line at each: a token carrying one used to cut the replica's event in two and fail the
# generation as "unreadable event" (seen in CI with the random-weights model).
SEPARATORS = ["a\u2028b", "\u2029", "c\x85", "\x1c\x1d\x1e", "\x0b\x0c", "\r", "d"]


def test_line_separators_in_token_text_reach_the_client_intact(gateway_for):
    gw = gateway_for(Script(texts=SEPARATORS, once=True, stop_reason="end_turn"))
    client = gw.client()
    ask = {**ASK, "max_tokens": len(SEPARATORS)}
    msg = client.messages.create(**ask)
    assert msg.content[0].text == "".join(SEPARATORS)
    assert msg.usage.output_tokens == len(SEPARATORS)
    with client.messages.stream(**ask) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == "".join(SEPARATORS)
    assert len(gw.wait_rows(2)) == 2  # both billed
