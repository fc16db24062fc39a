"""The gateway's limits: chunked and slow bodies, lone surrogates,
booleans as integers, a private /metrics, revocation at once, rate limits, request logs.

Each test drives a live gateway (real uvicorn, SQLite, a real tiny replica where a
reply is needed) over the wire, with the official SDK where a client is involved.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from datetime import datetime

import anthropic
import httpx
import pytest

MODEL = "cachepoint-tiny"
LIMIT = 200_000  # the gateway's max_body_bytes in these tests


@pytest.fixture
def gateway(seeded_db, serve, tiny_engine):
    """Start gateways on one seeded ledger and one tiny replica: gateway(**settings)
    -> {"url", "keys", "app"}."""
    from cachepoint.gateway.app import create_app
    from cachepoint.gateway.settings import GatewaySettings
    from cachepoint.replica.api.app import create_app as create_replica_app
    from cachepoint.replica.settings import ReplicaSettings

    db, keys = seeded_db
    replica: list[str] = []

    def start(**overrides: object) -> dict[str, object]:
        if not replica:
            replica.append(serve(create_replica_app(ReplicaSettings(name="r0"), tiny_engine)))
        settings = GatewaySettings(
            database_url=db,
            replica_urls=replica,
            min_cacheable_tokens=64,
            max_body_bytes=LIMIT,
            **overrides,
        )
        app = create_app(settings)
        return {"url": serve(app), "keys": keys, "app": app}

    return start


def _post(url: str, key: str, body: bytes | dict, path: str = "/v1/messages") -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"x-api-key": key, "content-type": "application/json"}
    return httpx.post(f"{url}{path}", content=raw, headers=headers, timeout=30)


def _error(r: httpx.Response) -> dict:
    body = r.json()
    assert body["type"] == "error"
    assert body["request_id"] == r.headers["request-id"]
    return body["error"]


def _small(text: str = "hi", **extra: object) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


# ------------------------------------------------------------------ body size


def test_chunked_body_over_the_limit_is_413_before_it_is_read(gateway):
    gw = gateway()
    sent = [0]
    chunk = b" " * 65_536

    def body():
        # A valid JSON body far over the limit, sent chunked (no content-length).
        head = json.dumps(_small("x"))[:-1].encode() + b', "metadata": {"user_id": "'
        yield head
        for _ in range(320):  # 20 MiB of padding
            sent[0] += len(chunk)
            yield chunk
        yield b'"}}'

    headers = {"x-api-key": gw["keys"]["a"], "content-type": "application/json"}
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{gw['url']}/v1/messages", content=body(), headers=headers)
    assert "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    err = _error(r)
    assert err["type"] == "request_too_large"
    assert str(LIMIT) in err["message"]
    # The gateway stopped reading and closed the connection: the client could push
    # only what the sockets' buffers hold (about 3.5 MiB here), never the whole body.
    assert sent[0] < 320 * len(chunk), sent[0]


async def test_the_body_guard_pulls_no_chunk_past_the_limit():
    """ASGI level, deterministic: a body that never ends is pulled only up to the
    chunk that crosses the limit, and the client gets a 413."""
    from cachepoint.gateway.api.middleware import RequestIdMiddleware

    pulled = 0

    async def endless() -> dict:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * 10_000, "more_body": True}

    async def app(scope, receive, send) -> None:
        while True:  # reads like Starlette's Request.body()
            message = await receive()
            if not message.get("more_body"):
                break
        raise AssertionError("unreachable")

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    guard = RequestIdMiddleware(app, max_body_bytes=LIMIT)
    scope = {"type": "http", "path": "/v1/messages", "headers": []}
    await guard(scope, endless, send)
    assert pulled == LIMIT // 10_000 + 1
    assert sent[0]["status"] == 413
    assert (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["type"] == "request_too_large"


def test_chunked_body_under_the_limit_is_served(gateway):
    gw = gateway()

    def body():
        raw = json.dumps(_small("chunked but small")).encode()
        for i in range(0, len(raw), 7):
            yield raw[i : i + 7]

    headers = {"x-api-key": gw["keys"]["a"], "content-type": "application/json"}
    r = httpx.post(f"{gw['url']}/v1/messages", content=body(), headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == 1


# ------------------------------------------------------------------ slow bodies


def _raw_request(url: str, key: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"x-api-key: {key}\r\n".encode()
        + b"transfer-encoding: chunked\r\n\r\n"
    )
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            raise AssertionError(f"connection closed without a response: {data!r}")
        data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return status, json.loads(rest[:length])


def test_a_stalled_body_gets_408_after_the_read_timeout(gateway):
    gw = gateway(body_read_timeout_s=0.5)
    sock = _raw_request(gw["url"], gw["keys"]["a"])
    part = b'{"model": "cachepoint-tiny", '
    sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")  # then nothing more
    t0 = time.monotonic()
    status, body = _read_response(sock)
    sock.close()
    assert status == 408
    assert body["error"]["type"] == "invalid_request_error"
    assert "0.5" in body["error"]["message"]
    assert time.monotonic() - t0 < 5


def test_a_trickled_body_gets_408_at_the_deadline_not_per_chunk(gateway):
    gw = gateway(body_read_timeout_s=1.0)
    sock = _raw_request(gw["url"], gw["keys"]["a"])
    t0 = time.monotonic()
    sock.settimeout(0.25)
    got = None
    # One byte every 0.25 s: each chunk arrives well within the timeout, the body never does.
    for _ in range(40):
        sock.sendall(b"1\r\n \r\n")
        try:
            if sock.recv(1, socket.MSG_PEEK):
                got = time.monotonic() - t0
                break
        except TimeoutError:
            continue
    assert got is not None, "the gateway waited 10 s for a trickled body"
    sock.settimeout(5)
    status, body = _read_response(sock)
    sock.close()
    assert status == 408
    assert body["error"]["type"] == "invalid_request_error"
    assert 0.9 < got < 4


# ------------------------------------------------------------------ body content


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_a_lone_surrogate_is_a_400_naming_its_path(gateway, path):
    gw = gateway()
    body = _small("placeholder")
    if path.endswith("count_tokens"):
        body.pop("max_tokens")
    raw = json.dumps(body).replace("placeholder", "ok \\ud800 then").encode()
    assert b"\\ud800" in raw
    r = _post(gw["url"], gw["keys"]["a"], raw, path)
    assert r.status_code == 400, r.text
    err = _error(r)
    assert err["type"] == "invalid_request_error"
    assert "messages.0.content" in err["message"]
    assert "surrogate" in err["message"]
    # The connection is still good for the next request.
    ok = _post(
        gw["url"],
        gw["keys"]["a"],
        _small("fine")
        if "count" not in path
        else {"model": MODEL, "messages": [{"role": "user", "content": "fine"}]},
        path,
    )
    assert ok.status_code == 200, ok.text


def test_a_surrogate_pair_is_fine_and_a_lone_one_in_a_tool_input_is_not(gateway):
    gw = gateway()
    pair = json.dumps(_small("emoji \U0001f600"))  # ensure_ascii: a valid \\ud83d\\ude00 pair
    assert "\\ud83d\\ude00" in pair
    assert _post(gw["url"], gw["keys"]["a"], pair.encode()).status_code == 200
    body = _small("x")
    body["messages"] = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"k": ["SURR"]}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]},
    ]
    raw = json.dumps(body).replace("SURR", "\\udfff").encode()
    r = _post(gw["url"], gw["keys"]["a"], raw)
    assert r.status_code == 400, r.text
    assert "messages.1.content.0.input.k.0" in _error(r)["message"]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("max_tokens", True, "valid integer"),
        ("top_k", True, "valid integer"),
        ("max_tokens", 1.0, "valid integer"),
        ("temperature", True, "valid number"),
        ("top_p", False, "valid number"),
        ("temperature", 1.5, "less than or equal to 1"),
        ("top_p", 0, "greater than 0"),
        ("top_k", -1, "greater than or equal to 0"),
        ("stream", 1, "valid boolean"),
    ],
)
def test_sampling_fields_are_strictly_typed_and_ranged(gateway, field, value, words):
    gw = gateway()
    r = _post(gw["url"], gw["keys"]["a"], _small(**{field: value}))
    assert r.status_code == 400, r.text
    msg = _error(r)["message"]
    assert msg.startswith(f"{field}:"), msg
    assert words in msg, msg


def test_integral_numbers_in_float_fields_still_pass(gateway):
    gw = gateway()
    r = _post(gw["url"], gw["keys"]["a"], _small(temperature=1, top_p=1, top_k=0))
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ /metrics


def _families(text: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name for f in text_string_to_metric_families(text)}


def test_metrics_leave_the_public_port_for_their_own(gateway):
    gw = gateway(metrics_port=0)
    c = anthropic.Anthropic(base_url=gw["url"], api_key=gw["keys"]["a"], max_retries=0)
    c.messages.create(**_small("bill me"))
    public = httpx.get(f"{gw['url']}/metrics")
    assert public.status_code == 404
    assert "cachepoint_billed" not in public.text
    metrics_url = gw["app"].state.metrics_url
    assert metrics_url.split(":")[-1] != gw["url"].split(":")[-1]
    text = httpx.get(f"{metrics_url}/metrics").text
    assert "cachepoint_billed_tokens" in _families(text)


def test_metrics_off_means_no_listener(gateway):
    gw = gateway()
    assert gw["app"].state.metrics_url is None
    assert httpx.get(f"{gw['url']}/metrics").status_code == 404


# ------------------------------------------------------------------ revocation


def _key_id(db: str, raw: str) -> str:
    from sqlalchemy import select

    from cachepoint.gateway.db.models import ApiKey
    from cachepoint.gateway.db.session import make_engine, make_sessionmaker
    from cachepoint.gateway.tenancy.tenants import hash_key

    engine = make_engine(db)
    with make_sessionmaker(engine)() as s:
        key_id = s.scalar(select(ApiKey.id).where(ApiKey.key_hash == hash_key(raw)))
    engine.dispose()
    assert key_id
    return key_id


def test_revocation_through_the_admin_api_takes_effect_at_once(gateway, seeded_db):
    gw = gateway(auth_cache_seconds=60)
    keys = gw["keys"]
    user = anthropic.Anthropic(base_url=gw["url"], api_key=keys["a"], max_retries=0)
    admin = anthropic.Anthropic(base_url=gw["url"], api_key=keys["a-admin"], max_retries=0)
    user.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "q"}])  # cached
    key_id = _key_id(seeded_db[0], keys["a"])
    got = admin.organization.api_keys.update(key_id, status="inactive")
    assert got.id == key_id
    assert got.status == "inactive"
    assert got.partial_key_hint and got.partial_key_hint.endswith(keys["a"][-4:])
    assert isinstance(got.created_at, datetime)
    with pytest.raises(anthropic.AuthenticationError):
        user.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "q"}])
    assert admin.organization.api_keys.retrieve(key_id).status == "inactive"


def test_an_admin_key_cannot_touch_another_orgs_key(gateway, seeded_db):
    gw = gateway()
    keys = gw["keys"]
    b_admin = anthropic.Anthropic(base_url=gw["url"], api_key=keys["b-admin"], max_retries=0)
    user_a = anthropic.Anthropic(base_url=gw["url"], api_key=keys["a"], max_retries=0)
    key_id = _key_id(seeded_db[0], keys["a"])
    with pytest.raises(anthropic.NotFoundError):
        b_admin.organization.api_keys.update(key_id, status="inactive")
    with pytest.raises(anthropic.PermissionDeniedError):
        user_a.organization.api_keys.update(key_id, status="inactive")
    assert (
        user_a.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "q"}]
        ).input_tokens
        > 0
    )


def test_a_key_can_be_restored_and_bad_updates_are_400s(gateway, seeded_db):
    gw = gateway()
    keys = gw["keys"]
    admin = anthropic.Anthropic(base_url=gw["url"], api_key=keys["a-admin"], max_retries=0)
    user = anthropic.Anthropic(base_url=gw["url"], api_key=keys["a"], max_retries=0)
    key_id = _key_id(seeded_db[0], keys["a"])
    path = f"/v1/organizations/api_keys/{key_id}"
    bad = _post(gw["url"], keys["a-admin"], b'{"name": "x \\ud800"}', path)
    assert bad.status_code == 400
    assert _error(bad)["message"].startswith("name: a lone surrogate")
    archived = _post(gw["url"], keys["a-admin"], {"status": "archived"}, path)
    assert archived.status_code == 400
    assert admin.organization.api_keys.update(key_id, status="inactive").status == "inactive"
    with pytest.raises(anthropic.AuthenticationError):
        user.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "q"}])
    restored = admin.organization.api_keys.update(key_id, status="active", name="restored")
    assert (restored.status, restored.name) == ("active", "restored")
    assert (
        user.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": "q"}]
        ).input_tokens
        > 0
    )


# ------------------------------------------------------------------ rate limits


def test_requests_per_minute_give_429_with_retry_after_and_headers(gateway):
    gw = gateway(key_requests_per_minute=2)
    c = anthropic.Anthropic(base_url=gw["url"], api_key=gw["keys"]["a"], max_retries=0)
    first = c.messages.with_raw_response.create(**_small("one"))
    h = first.headers
    assert h["anthropic-ratelimit-requests-limit"] == "2"
    assert h["anthropic-ratelimit-requests-remaining"] == "1"
    reset = datetime.fromisoformat(h["anthropic-ratelimit-requests-reset"])
    assert reset.tzinfo is not None
    assert int(h["anthropic-ratelimit-input-tokens-limit"]) > 0
    assert "anthropic-ratelimit-input-tokens-remaining" in h
    datetime.fromisoformat(h["anthropic-ratelimit-input-tokens-reset"])
    c.messages.create(**_small("two"))
    with pytest.raises(anthropic.RateLimitError) as exc:
        c.messages.create(**_small("three"))
    r = exc.value.response
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(r.headers["retry-after"]) <= 30
    assert r.headers["anthropic-ratelimit-requests-remaining"] == "0"
    # Another org is not throttled by org a's key.
    other = anthropic.Anthropic(base_url=gw["url"], api_key=gw["keys"]["b"], max_retries=0)
    assert other.messages.create(**_small("b")).usage.output_tokens == 1


def test_input_tokens_per_minute_limit_the_next_request(gateway):
    gw = gateway(org_input_tokens_per_minute=100)
    c = anthropic.Anthropic(base_url=gw["url"], api_key=gw["keys"]["a"], max_retries=0)
    big = c.messages.with_raw_response.create(**_small("x" * 300))
    assert big.headers["anthropic-ratelimit-input-tokens-limit"] == "100"
    with pytest.raises(anthropic.RateLimitError) as exc:
        c.messages.create(**_small("again"))
    assert "input tokens" in exc.value.response.json()["error"]["message"]
    assert int(exc.value.response.headers["retry-after"]) >= 60  # 300 tokens at 100/min


# ------------------------------------------------------------------ request logs


def _lines(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "cachepoint.requests"]


def _wait_lines(caplog, n: int) -> list[dict]:
    deadline = time.time() + 5
    while len(_lines(caplog)) < n and time.time() < deadline:
        time.sleep(0.02)
    return _lines(caplog)


def test_one_json_line_per_request_with_the_bill(gateway, seeded_db, caplog):
    caplog.set_level(logging.INFO, logger="cachepoint.requests")
    gw = gateway()
    c = anthropic.Anthropic(base_url=gw["url"], api_key=gw["keys"]["a"], max_retries=0)
    sys_block = {
        "type": "text",
        "text": "Logged prefix. " * 8,
        "cache_control": {"type": "ephemeral"},
    }
    msg = c.messages.create(
        model=MODEL, max_tokens=2, system=[sys_block], messages=[{"role": "user", "content": "q"}]
    )
    with c.messages.stream(
        model=MODEL, max_tokens=2, system=[sys_block], messages=[{"role": "user", "content": "q"}]
    ) as s:
        streamed = s.get_final_message()
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "q"}])
    c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "q"}])
    lines = _wait_lines(caplog, 4)
    assert len(lines) == 4, lines
    # NOTE: matched by content, not order: a stream's line is written after its last
    # event has left, which under load can be after the next request's line.
    (first,) = [x for x in lines if x["request_id"] == msg._request_id]
    (stream,) = [x for x in lines if x["stream"] is True]
    (bad,) = [x for x in lines if x["status"] == 400]
    (count,) = [x for x in lines if x["path"] == "/v1/messages/count_tokens"]
    key_id = _key_id(seeded_db[0], gw["keys"]["a"])
    assert first["request_id"] == msg._request_id
    assert first["path"] == "/v1/messages"
    assert first["status"] == 200
    assert first["key_id"] == key_id
    assert first["org"].startswith("org_")
    assert first["model"] == MODEL
    assert first["replica"] == "r0"
    assert first["stream"] is False
    u = msg.usage
    assert first["input_tokens"] == u.input_tokens
    assert first["cache_read_input_tokens"] == u.cache_read_input_tokens
    assert first["cache_write_5m_tokens"] == u.cache_creation.ephemeral_5m_input_tokens
    assert first["cache_write_1h_tokens"] == 0
    assert first["output_tokens"] == u.output_tokens
    assert first["error_type"] is None
    assert first["latency_ms"] > 0
    assert stream["stream"] is True
    assert stream["status"] == 200
    assert stream["cache_read_input_tokens"] == streamed.usage.cache_read_input_tokens > 0
    assert stream["output_tokens"] == streamed.usage.output_tokens
    assert bad["status"] == 400
    assert bad["error_type"] == "invalid_request_error"
    assert bad["input_tokens"] is None
    assert count["path"] == "/v1/messages/count_tokens"
    assert count["status"] == 200
    assert count["key_id"] == key_id


def test_the_gateway_command_logs_request_lines_at_log_level_warning(
    seeded_db, free_port, tmp_path
):
    """`cachepoint-gateway --log-level warning` (as the embedded stack runs it) still
    writes each request's JSON line to stderr, which the stack keeps in gateway.log."""
    import os
    import subprocess
    import sys

    db, keys = seeded_db
    port = free_port()
    log = tmp_path / "gateway.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachepoint.gateway.cli",
                "--port",
                str(port),
                "--db",
                db,
                "--log-level",
                "warning",
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONSAFEPATH": "1"},
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            time.sleep(0.1)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}]}
        r = _post(url, keys["a"], body, "/v1/messages/count_tokens")
        assert r.status_code == 200
        rid = r.headers["request-id"]
        deadline = time.time() + 10
        while rid not in log.read_text() and time.time() < deadline:
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(15)
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    mine = [x for x in lines if x["request_id"] == rid]
    assert len(mine) == 1, log.read_text()
    assert mine[0]["status"] == 200
    assert mine[0]["path"] == "/v1/messages/count_tokens"
    assert mine[0]["model"] == MODEL
