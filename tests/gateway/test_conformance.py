"""The official anthropic SDK against a live gateway and a real replica.

Expected bucket numbers are computed here from the documented rendering, not by
asking the gateway: the byte tokenizer maps each UTF-8 byte to one token, and each
content block ends with one separator token.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

MODEL = "cachepoint-tiny"
SYSTEM = "You are the support agent for a company that sells kettles. " * 4
BOS, HEADER, SEP, GEN = 1, 1, 1, 1  # <|bos|>, a role header, <|sep|>, the final <|assistant|>


def client(stack, who: str = "a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack["url"], api_key=stack["keys"][who], max_retries=0)


def n(text: str) -> int:
    return len(text.encode())


def buckets(u) -> tuple[int, int, int, int]:
    cc = u.cache_creation
    assert (
        u.cache_creation_input_tokens == cc.ephemeral_5m_input_tokens + cc.ephemeral_1h_input_tokens
    )
    return (
        u.input_tokens,
        u.cache_read_input_tokens,
        cc.ephemeral_5m_input_tokens,
        cc.ephemeral_1h_input_tokens,
    )


def cached(text: str, ttl: str | None = None) -> dict:
    cc = {"type": "ephemeral"} | ({"ttl": ttl} if ttl else {})
    return {"type": "text", "text": text, "cache_control": cc}


def test_conformance_multi_turn_reads_what_the_first_turn_wrote(stack):
    c = client(stack)
    u1, a1, u2 = "Where is my order #1234?", "It ships tomorrow.", "Can I change the address?"
    r1 = c.messages.create(
        model=MODEL,
        max_tokens=8,
        system=SYSTEM,
        messages=[{"role": "user", "content": [cached(u1)]}],
    )
    p1 = BOS + HEADER + n(SYSTEM) + SEP + HEADER + n(u1) + SEP
    assert buckets(r1.usage) == (GEN, 0, p1, 0)
    assert r1._request_id.startswith("req_")
    r2 = c.messages.create(
        model=MODEL,
        max_tokens=8,
        system=SYSTEM,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": u1}]},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": [cached(u2)]},
        ],
    )
    p2 = p1 + HEADER + n(a1) + SEP + HEADER + n(u2) + SEP
    # Turn 2's breakpoint looks back over block boundaries and finds turn 1's entry.
    assert buckets(r2.usage) == (GEN, p1, p2 - p1, 0)
    assert r2.usage.output_tokens >= 1


def test_conformance_mixed_ttls(stack):
    c = client(stack)
    system = [cached(SYSTEM, "1h")]
    u = "Is the blue kettle in stock?"
    ps = BOS + HEADER + n(SYSTEM) + SEP
    pu = ps + HEADER + n(u) + SEP
    r1 = c.messages.create(
        model=MODEL,
        max_tokens=4,
        system=system,
        messages=[{"role": "user", "content": [cached(u)]}],
    )
    assert buckets(r1.usage) == (GEN, 0, pu - ps, ps)  # B - A = ps at 1h; C - B at 5m
    r2 = c.messages.create(
        model=MODEL,
        max_tokens=4,
        system=system,
        messages=[{"role": "user", "content": [cached(u)]}],
    )
    assert buckets(r2.usage) == (GEN, pu, 0, 0)
    other = "And the red one?"
    r3 = c.messages.create(
        model=MODEL,
        max_tokens=4,
        system=system,
        messages=[{"role": "user", "content": [cached(other)]}],
    )
    po = ps + HEADER + n(other) + SEP
    assert buckets(r3.usage) == (GEN, ps, po - ps, 0)


def test_conformance_automatic_caching(stack):
    c = client(stack)
    msgs = [{"role": "user", "content": "Tell me about descaling. " * 5}]
    r1 = c.messages.create(
        model=MODEL, max_tokens=4, system=SYSTEM, messages=msgs, cache_control={"type": "ephemeral"}
    )
    p = BOS + HEADER + n(SYSTEM) + SEP + HEADER + n(msgs[0]["content"]) + SEP
    assert buckets(r1.usage) == (GEN, 0, p, 0)
    r2 = c.messages.create(
        model=MODEL, max_tokens=4, system=SYSTEM, messages=msgs, cache_control={"type": "ephemeral"}
    )
    assert buckets(r2.usage) == (GEN, p, 0, 0)


def test_conformance_streaming_matches_non_streaming(stack):
    c = client(stack)
    kw = dict(
        model=MODEL,
        max_tokens=12,
        system=SYSTEM,
        messages=[{"role": "user", "content": [cached("Stream this please.")]}],
        extra_body={"temperature": 0.0},
    )
    c.messages.create(**kw)  # write
    plain = c.messages.create(**kw)
    with c.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.usage == plain.usage
    assert final.content[0].text == text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason


def test_conformance_count_tokens(stack):
    c = client(stack)
    r = c.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": "hi"}]
    )
    assert r.input_tokens == BOS + HEADER + n(SYSTEM) + SEP + HEADER + 2 + SEP + GEN


def test_conformance_orgs_are_isolated(stack):
    a, b = client(stack, "a"), client(stack, "b")
    msgs = [{"role": "user", "content": [cached("Same words, different tenant. " * 3)]}]
    a.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=msgs)
    assert (
        a.messages.create(
            model=MODEL, max_tokens=2, system=SYSTEM, messages=msgs
        ).usage.cache_read_input_tokens
        > 0
    )
    rb = b.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=msgs)
    assert rb.usage.cache_read_input_tokens == 0  # org b never hits org a's blocks
    params = {"starting_at": "2026-01-01T00:00:00Z", "bucket_width": "1d", "limit": 31}

    def total_input(who: str) -> int:
        h = {"x-api-key": stack["keys"][f"{who}-admin"]}
        total, page = 0, None
        while True:
            q = params | ({"page": page} if page else {})
            rep = httpx.get(
                f"{stack['url']}/v1/organizations/usage_report/messages", params=q, headers=h
            ).json()
            total += sum(
                r["uncached_input_tokens"]
                + r["cache_read_input_tokens"]
                + r["cache_creation"]["ephemeral_5m_input_tokens"]
                for d in rep["data"]
                for r in d["results"]
            )
            if not rep["has_more"]:
                return total
            page = rep["next_page"]

    # b's admin sees exactly b's one request; a's usage is not visible to it.
    assert total_input("b") == rb.usage.input_tokens + rb.usage.cache_creation_input_tokens
    denied = httpx.get(
        f"{stack['url']}/v1/organizations/usage_report/messages",
        params=params,
        headers={"x-api-key": stack["keys"]["b"]},
    )
    assert denied.status_code == 403


@pytest.mark.parametrize(
    ("make_call", "exc", "fragment"),
    [
        (
            lambda c: c.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [cached("x")] * 5}]
            ),
            anthropic.BadRequestError,
            "A maximum of 4 blocks with cache_control may be provided. Found 5.",
        ),
        (
            lambda c: c.messages.create(
                model=MODEL,
                max_tokens=4,
                messages=[
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": [
                            {
                                "type": "thinking",
                                "thinking": "t",
                                "signature": "s",
                                "cache_control": {"type": "ephemeral"},
                            }
                        ],
                    },
                ],
            ),
            anthropic.BadRequestError,
            "messages.1.content.0.cache_control",
        ),
        (
            lambda c: c.messages.create(
                model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "q"}]
            ),
            anthropic.NotFoundError,
            "model: no-such-model",
        ),
        (
            lambda c: c.messages.create(
                model=MODEL,
                max_tokens=4,
                messages=[{"role": "user", "content": "q"}],
                # NOTE: unknown betas are accepted, as Claude Code sends new ones
                # (strict_betas opts back in; tests/gateway/test_client_shapes.py); a
                # server tool is not.
                extra_body={"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            ),
            anthropic.BadRequestError,
            "tools.0: server tool web_search_20250305 is not available",
        ),
        (
            lambda c: c.messages.create(
                model=MODEL,
                max_tokens=4,
                messages=[{"role": "user", "content": "q"}],
                extra_body={"bogus": 1},
            ),
            anthropic.BadRequestError,
            "bogus: Extra inputs are not permitted",
        ),
        (
            lambda c: c.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x" * 300_000}]
            ),
            anthropic.ContentTooLargeError,
            "exceeds",
        ),
        (
            lambda c: c.messages.create(
                model=MODEL, max_tokens=5000, messages=[{"role": "user", "content": "x" * 5000}]
            ),
            anthropic.BadRequestError,
            "input length and `max_tokens` exceed context limit: ",
        ),
    ],
)
def test_conformance_errors_are_sdk_exceptions(stack, make_call, exc, fragment):
    with pytest.raises(exc) as info:
        make_call(client(stack))
    body = info.value.body
    assert body["type"] == "error"
    assert fragment in body["error"]["message"]
    assert body["request_id"].startswith("req_")


def test_conformance_auth_errors(stack):
    bad = anthropic.Anthropic(base_url=stack["url"], api_key="sk-cp-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "q"}])
    with pytest.raises(anthropic.PermissionDeniedError, match="admin keys cannot send messages"):
        client(stack, "a-admin").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "q"}]
        )
    r = httpx.post(f"{stack['url']}/v1/messages", json={})
    assert r.status_code == 401
    assert r.headers["request-id"].startswith("req_")


@pytest.mark.parametrize(
    ("status", "exc"),
    [
        (429, anthropic.RateLimitError),
        (503, anthropic.OverloadedError),
        (500, anthropic.InternalServerError),
    ],
)
def test_conformance_replica_failures_map_to_sdk_errors(seeded_db, serve, status, exc):
    from cachepoint.gateway.app import create_app
    from cachepoint.gateway.settings import GatewaySettings
    from cachepoint.replica.echo import create_echo_app

    replica = serve(create_echo_app(fail_with=status))
    db, keys = seeded_db
    url = serve(create_app(GatewaySettings(database_url=db, replica_urls=[replica])))
    c = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    with pytest.raises(exc) as info:
        c.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "q"}])
    assert "echo replica configured" in info.value.body["error"]["message"]


def test_conformance_unreachable_replica_is_overloaded(seeded_db, serve, free_port):
    from cachepoint.gateway.app import create_app
    from cachepoint.gateway.settings import GatewaySettings

    db, keys = seeded_db
    url = serve(
        create_app(
            GatewaySettings(database_url=db, replica_urls=[f"http://127.0.0.1:{free_port()}"])
        )
    )
    c = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    with pytest.raises(anthropic.OverloadedError, match="no replica can take the request"):
        c.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "q"}])


def test_conformance_stream_disconnect_bills_what_ran_and_aborts(stack):
    import time

    from sqlalchemy import create_engine, text

    body = {
        "model": MODEL,
        "max_tokens": 3000,
        "stream": True,
        "messages": [{"role": "user", "content": "long answer please"}],
    }
    headers = {"x-api-key": stack["keys"]["a"]}
    with httpx.stream("POST", f"{stack['url']}/v1/messages", json=body, headers=headers) as r:
        rid = r.headers["request-id"]
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:
                break  # hang up mid-generation
    engine = create_engine(stack["db"])
    deadline = time.time() + 15
    while True:
        with engine.connect() as conn:
            row = conn.execute(
                text("SELECT output_tokens FROM usage WHERE request_id = :r"), {"r": rid}
            ).first()
        stats = httpx.get(f"{stack['replica']}/v1/stats").json()
        if row is not None and stats["running"] == 0:
            break
        assert time.time() < deadline, f"row={row} stats={stats}"
        time.sleep(0.05)
    engine.dispose()
    assert 1 <= row[0] < 3000  # billed for the tokens generated before the hang-up
    assert stats["blocks"]["active"] == 0
