"""Exactly-once billing on the request path.

The gateway runs for real (uvicorn, SQLite or PostgreSQL ledger) with the official SDK
as its client. Its replica is scripted (tests/gateway/scripted.py): a small app that
speaks the replica API with chosen token texts, a chosen pace, or a forged usage
report, and records how many token events it actually wrote per request; or a raw
socket server that starts a stream and then resets the connection, as a replica
killed mid-stream does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import pytest
from sqlalchemy import text, update

from cachepoint.gateway.app import create_app
from cachepoint.gateway.db.models import IdempotencyRecord
from cachepoint.gateway.db.session import make_engine
from cachepoint.gateway.settings import GatewaySettings

from .scripted import MODEL, Gateway, Script, StaticRouter, gateway_factory, scripted_replica
from .scripted import seed as _seed

MSGS = [{"role": "user", "content": "Tell me about kettles."}]


@pytest.fixture
def gateway_for(serve, tmp_path):
    return gateway_factory(serve, tmp_path)


# ------------------------------------------------------------------ idempotency keys


def _post(gw: Gateway, key: str | None, who: str = "a", **body: Any) -> httpx.Response:
    headers = {"x-api-key": gw.keys[who], "anthropic-version": "2023-06-01"}
    if key is not None:
        headers["idempotency-key"] = key
    payload = {"model": MODEL, "max_tokens": 5, "messages": MSGS, **body}
    return httpx.post(f"{gw.url}/v1/messages", json=payload, headers=headers, timeout=30)


def test_idempotency_key_replays_the_first_result_and_bills_once(gateway_for, db_url):
    script = Script(delay_s=0.05)
    gw = gateway_for(script, db_url)
    first = _post(gw, "k-1")
    assert first.status_code == 200, first.text
    again = _post(gw, "k-1")
    assert again.status_code == 200
    assert again.content == first.content  # same message id, text and usage
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["cachepoint-original-request-id"] == first.headers["request-id"]
    assert again.headers["cachepoint-replica"] == first.headers["cachepoint-replica"]
    assert script.calls == 1
    assert [r.output_tokens for r in gw.rows()] == [5]

    # Same key, different body: refused plainly, nothing generated.
    other = _post(gw, "k-1", max_tokens=6)
    assert other.status_code == 400
    err = other.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert "idempotency-key" in err["message"] and "different request body" in err["message"]
    # The key is per API key: another org's identical key is its own request.
    theirs = _post(gw, "k-1", who="b")
    assert theirs.status_code == 200
    assert theirs.json()["id"] != first.json()["id"]
    # Concurrent duplicates while the first is in flight wait for it, then replay it.
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _post(gw, "k-2"), range(4)))
    assert {a.status_code for a in answers} == {200}
    assert len({a.content for a in answers}) == 1
    assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 3
    assert script.calls == 3
    assert len(gw.rows()) == 3


def test_idempotency_key_expires_after_24h_and_bad_keys_are_refused(gateway_for):
    script = Script()
    gw = gateway_for(script)
    first = _post(gw, "k-old")
    engine = make_engine(gw.db)
    with engine.begin() as conn:
        old = int(time.time()) - 24 * 3600 - 5
        conn.execute(update(IdempotencyRecord).values(created_s=old))
    engine.dispose()
    fresh = _post(gw, "k-old")
    assert fresh.status_code == 200
    assert fresh.json()["id"] != first.json()["id"]
    assert "idempotent-replayed" not in fresh.headers
    assert script.calls == 2
    bad = _post(gw, "x" * 256)
    assert bad.status_code == 400 and "idempotency-key" in bad.json()["error"]["message"]


def test_idempotency_duplicate_waits_at_most_the_upstream_timeout_then_gets_409(gateway_for):
    # The first request generates for 2 s; a duplicate waits 1 s (upstream_timeout_s).
    script = Script(delay_s=0.04)
    gw = gateway_for(script, upstream_timeout_s=1.0)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_post, gw, "k-slow", max_tokens=50)
        time.sleep(0.3)
        t0 = time.time()
        dup = _post(gw, "k-slow", max_tokens=50)
        waited = time.time() - t0
        assert first.result().status_code == 200
    assert dup.status_code == 409
    assert dup.json()["error"]["type"] == "invalid_request_error"
    assert "still in progress" in dup.json()["error"]["message"]
    assert 0.9 < waited < 1.8
    after = _post(gw, "k-slow", max_tokens=50)
    assert after.content == first.result().content
    assert script.calls == 1
    assert [r.output_tokens for r in gw.rows()] == [50]


def test_idempotency_key_replays_a_stream(gateway_for):
    script = Script(texts=["x", "y"])
    gw = gateway_for(script)
    c = gw.client(default_headers={"idempotency-key": "k-stream"})
    runs = []
    for _ in range(2):
        with c.messages.stream(model=MODEL, max_tokens=4, messages=MSGS) as stream:
            events = [(e.type, getattr(e, "index", None)) for e in stream]
            runs.append((events, stream.get_final_message()))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1].id == runs[1][1].id
    assert runs[1][1].content[0].text == "xyxy"
    assert runs[1][1].usage.output_tokens == 4
    assert script.calls == 1
    assert len(gw.rows()) == 1


# ------------------------------------------------------- disconnects and SDK retries


def test_retry_storm_without_key_bills_only_what_each_attempt_generated(gateway_for):
    # 300 tokens at 20 ms: 6 s of generation against a 2 s client timeout, 2 retries.
    script = Script(delay_s=0.02)
    gw = gateway_for(script)
    c = gw.client(timeout=2.0, max_retries=2)
    t0 = time.time()
    with pytest.raises(anthropic.APITimeoutError):
        c.messages.create(model=MODEL, max_tokens=300, messages=MSGS)
    assert time.time() - t0 < 12
    rows = gw.wait_rows(3)
    assert len(rows) == 3  # one per attempt: each attempt did generate something
    time.sleep(0.5)  # let the replica notice the last hang-up
    for r in rows:
        sent = script.sent[r.request_id]
        assert r.request_id not in script.finished, "the generation was not stopped"
        # NOTE: a token line in flight when the gateway closes the connection was
        # written by the replica but never read: it cannot be billed.
        assert sent - 1 <= r.output_tokens <= sent
        assert 0 < r.output_tokens < 300


def test_retry_storm_with_key_generates_and_bills_once(gateway_for):
    # 3 s of generation against a 2 s timeout: the first attempt times out, the
    # generation goes on, and the retry with the same key receives its result.
    script = Script(delay_s=0.02)
    gw = gateway_for(script)
    c = gw.client(timeout=2.0, max_retries=2)
    msg = c.messages.create(
        model=MODEL,
        max_tokens=150,
        messages=MSGS,
        extra_headers={"idempotency-key": f"retry-{uuid.uuid4()}"},
    )
    assert msg.usage.output_tokens == 150
    assert script.calls == 1
    rows = gw.rows()
    assert [r.output_tokens for r in rows] == [150]


# --------------------------------------------------------------- usage report checks


@pytest.mark.parametrize(
    "forge",
    [
        {"cache": {"prompt_tokens": 10_000_000}},
        {"cache": {"written_1h_tokens": 10_000_000, "prompt_tokens": None}},
        {"cache": {"entry_hit_tokens": -3}},
        {"cache": {"written_5m_tokens": 1.5}},
        {"extra_tokens": 1000},
        {"final_delta": 1_000_000},
    ],
    ids=["prompt", "buckets-overflow", "negative", "non-integer", "output-tokens", "final"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_forged_usage_reports_are_refused_unbilled(gateway_for, forge, stream):
    script = Script(**{k: v for k, v in forge.items() if k != "cache"})
    script.cache = {k: v for k, v in forge.get("cache", {}).items() if v is not None}
    gw = gateway_for(script)
    c = gw.client()

    def call() -> None:
        if stream:
            with c.messages.stream(model=MODEL, max_tokens=4, messages=MSGS) as s:
                s.until_done()
        else:
            c.messages.create(model=MODEL, max_tokens=4, messages=MSGS)

    with pytest.raises(anthropic.APIStatusError) as info:
        call()
    body = info.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "api_error"
    assert "usage report" in body["error"]["message"]
    assert gw.rows() == []
    assert gw.router.failures == ["fake"]


# ------------------------------------------------------------ a replica dies mid-stream


class DyingReplica:
    """Starts a /v1/generate stream, writes `after` token events and resets the
    connection: what the gateway sees when a replica is killed mid-stream."""

    def __init__(self, texts: list[str], after: int) -> None:
        self.texts = texts
        self.after = after
        self.loop = asyncio.new_event_loop()
        self.url = ""

    def __enter__(self) -> DyingReplica:
        ready = threading.Event()

        async def main() -> None:
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            ready.set()

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(main(), self.loop)
        ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        body = json.loads(await reader.readexactly(length))
        n = len(body["token_ids"])
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )

        def chunk(obj: object) -> None:
            data = (json.dumps(obj) + "\n").encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))

        cache = {"prompt_tokens": n, "entry_hit_tokens": 0, "written_5m_tokens": 0}
        chunk({"type": "prefill_done", "cache": {**cache, "written_1h_tokens": 0}})
        for i in range(self.after):
            chunk({"type": "token", "token_id": i, "text": self.texts[i % len(self.texts)]})
            await writer.drain()
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)
        writer.transport.abort()  # RST, no final chunk: the process is gone


@pytest.fixture
def log_records() -> Iterator[list[logging.LogRecord]]:
    """Everything logged, uvicorn's own loggers included (they do not propagate)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.DEBUG)
    loggers = [
        logging.getLogger(),
        logging.getLogger("uvicorn"),
        logging.getLogger("uvicorn.error"),
    ]
    for lg in loggers:
        lg.addHandler(handler)
    yield records
    for lg in loggers:
        lg.removeHandler(handler)


def test_replica_killed_mid_stream_ends_with_an_error_event_billed_as_delivered(
    serve, tmp_path, log_records
):
    # A byte tokenizer sends a 3-byte character as two empty deltas and the character:
    # after 17 tokens the client has 5 characters (15 tokens) and 2 tokens are held.
    with DyingReplica(["", "", "€"], after=17) as replica:
        db = f"sqlite:///{tmp_path}/gw.db"
        keys = _seed(db)
        router = StaticRouter(replica.url)
        url = serve(create_app(GatewaySettings(database_url=db), router=router))
        gw = Gateway(url, db, keys, router)
        received: list[str] = []

        def read() -> None:
            with gw.client().messages.stream(model=MODEL, max_tokens=100, messages=MSGS) as s:
                received.extend(s.text_stream)

        with pytest.raises(anthropic.APIStatusError) as info:
            read()
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "api_error"
    assert "stream failed" in body["error"]["message"]
    text_received = "".join(received)
    assert text_received == "€" * 5
    rows = gw.wait_rows(1)
    assert [r.output_tokens for r in rows] == [len(text_received.encode())] == [15]
    assert router.failures == ["fake"]
    tracebacks = [r for r in log_records if r.exc_info and r.levelno >= logging.ERROR]
    assert tracebacks == []
    warnings = [r.getMessage() for r in log_records if r.name.startswith("cachepoint.gateway")]
    assert any("stream failed" in m for m in warnings)


# ------------------------------------------- hang-ups around the prefill and the charge


def _key_rows(gw: Gateway) -> list[Any]:
    engine = make_engine(gw.db)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text("SELECT key, status FROM idempotency_keys")))
    finally:
        engine.dispose()


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_hang_up_during_prefill_drops_the_request_unbilled(gateway_for, stream):
    # Queue + prefill take 3 s; the SDK gives up after 0.5 s and retries twice. Each
    # attempt's hang-up reaches the replica before its prefill is done: nothing billed.
    script = Script(prefill_s=3.0, delay_s=0.05)
    gw = gateway_for(script)
    c = gw.client(timeout=0.5, max_retries=2)
    key = {"idempotency-key": f"pf-{uuid.uuid4()}"}  # streams hold a key; creates do not

    def call() -> None:
        if stream:
            with c.messages.stream(
                model=MODEL, max_tokens=5, messages=MSGS, extra_headers=key
            ) as s:
                s.until_done()
        else:
            c.messages.create(model=MODEL, max_tokens=5, messages=MSGS)

    with pytest.raises(anthropic.APITimeoutError):
        call()
    deadline = time.time() + 2
    while len(script.dropped) < script.calls and time.time() < deadline:
        time.sleep(0.05)
    assert script.calls == 3
    assert len(script.dropped) == 3, "the upstream was kept open through the prefill"
    assert script.sent == {}  # no prefill_done ever went out
    time.sleep(0.3)
    assert gw.rows() == []
    assert _key_rows(gw) == []  # the key was released: a later retry runs afresh


def test_stream_cut_after_its_final_charge_keeps_its_key(serve, tmp_path):
    # The network write of message_delta is slow (the socket buffer is full); the client
    # hangs up after content_block_stop, meanwhile. The final charge is written by then,
    # so the key keeps the whole stream: the retry replays it instead of generating and
    # billing again.
    script = Script(texts=["x", "y"])
    db = f"sqlite:///{tmp_path}/gw.db"
    keys = _seed(db)
    router = StaticRouter(serve(scripted_replica(script)))
    app = create_app(GatewaySettings(database_url=db), router=router)

    async def slow_network(scope: Any, receive: Any, send: Any) -> None:
        async def slow_send(message: dict[str, Any]) -> None:
            if b"message_delta" in message.get("body", b""):
                await asyncio.sleep(0.5)
            await send(message)

        await app(scope, receive, slow_send)

    gw = Gateway(serve(slow_network), db, keys, router)
    c = gw.client(default_headers={"idempotency-key": f"cut-{uuid.uuid4()}"})
    with c.messages.stream(model=MODEL, max_tokens=4, messages=MSGS) as s:
        for event in s:
            if event.type == "content_block_stop":
                break  # hang up: closes the connection
    assert [r.output_tokens for r in gw.wait_rows(1)] == [4]
    deadline = time.time() + 5
    while (rows := _key_rows(gw)) and rows[0].status is None and time.time() < deadline:
        time.sleep(0.05)
    with c.messages.stream(model=MODEL, max_tokens=4, messages=MSGS) as s:
        msg = s.get_final_message()
    assert msg.content[0].text == "xyxy"
    assert msg.usage.output_tokens == 4
    assert script.calls == 1
    assert [r.output_tokens for r in gw.rows()] == [4]


def test_stream_billing_failure_still_stops_the_replica_and_frees_the_key(
    gateway_for, monkeypatch, log_records
):
    # The ledger is down when a client hangs up mid-stream: the replica is still told
    # to stop, the key is released, and the failure is one log line, no traceback.
    from sqlalchemy.exc import OperationalError

    from cachepoint.gateway import streaming

    async def failing_bill(*args: Any, **kw: Any) -> None:
        raise OperationalError("INSERT INTO usage", {}, Exception("database is down"))

    monkeypatch.setattr(streaming, "bill", failing_bill)
    script = Script(texts=["x"], delay_s=0.05)
    gw = gateway_for(script)
    c = gw.client(default_headers={"idempotency-key": f"down-{uuid.uuid4()}"})
    with c.messages.stream(model=MODEL, max_tokens=100, messages=MSGS) as s:
        for i, _ in enumerate(s.text_stream):
            if i == 2:
                break  # hang up after 3 deltas
    time.sleep(0.6)
    (rid,) = script.sent
    stopped_at = script.sent[rid]
    time.sleep(0.5)
    assert script.sent[rid] == stopped_at < 100, "the replica kept generating"
    assert rid not in script.finished
    assert _key_rows(gw) == []
    tracebacks = [r for r in log_records if r.exc_info and r.levelno >= logging.ERROR]
    assert tracebacks == []
    lines = [r.getMessage() for r in log_records if r.name.startswith("cachepoint.gateway")]
    assert sum("could not bill" in m for m in lines) == 1
