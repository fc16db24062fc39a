"""Request intake: JSON the parser accepts but the pipeline cannot handle is a
400 naming the path (never a 500), caps on a body's shape, the bounded tokenizing of an
overlong prompt, and count_tokens' own rate limit."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from cachepoint.gateway.errors import ApiError
from cachepoint.gateway.intake.body import BodyLimits, check_counts, parse_json, too_deep

from .scripted import MODEL, Gateway, Script, gateway_factory

MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture
def gateway_for(serve, tmp_path):
    return gateway_factory(serve, tmp_path)


def post(
    gw: Gateway, body: Any, path: str = "/v1/messages", headers: dict[str, str] | None = None
) -> httpx.Response:
    h = {"x-api-key": gw.keys["a"], "content-type": "application/json", **(headers or {})}
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{gw.url}{path}", content=raw, headers=h, timeout=60)


def refused(r: httpx.Response) -> str:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["request_id"].startswith("req_")
    return str(body["error"]["message"])


def nested(depth: int) -> dict[str, Any]:
    """A JSON schema ``depth`` objects deep (``{"properties": {"a": ...}}`` chains)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tool_body(schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    tool = {"name": "f", "description": "d", "input_schema": schema}
    return {"model": MODEL, "max_tokens": 4, "tools": [tool], "messages": MSGS, **extra}


def deep_tool_body(depth: int, count: bool = False) -> bytes:
    """``tool_body(nested(depth))`` as JSON text, built without json.dumps, whose
    encoder itself stops near 1,000 levels."""
    schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
    head = f'{{"model": "{MODEL}", ' + ("" if count else '"max_tokens": 4, ')
    tools = f'"tools": [{{"name": "f", "description": "d", "input_schema": {schema}}}], '
    return (head + tools + f'"messages": {json.dumps(MSGS)}}}').encode()


# ------------------------------------------------------------------ pure checks


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_parse_refuses_non_json_numbers(constant):
    with pytest.raises(ApiError) as info:
        parse_json(f'{{"a": [1, {constant}]}}'.encode())
    assert info.value.status == 400 and constant in info.value.message


def test_parse_names_bad_utf8_and_syntax():
    with pytest.raises(ApiError, match="not valid UTF-8"):
        parse_json(b'{"a": "\xff"}')
    with pytest.raises(ApiError, match="not valid JSON"):
        parse_json(b'{"a": ')


def test_too_deep_names_the_first_path_past_the_limit_without_recursion():
    assert too_deep({"a": [{"b": 1}]}, 3) is None
    assert too_deep({"a": [{"b": {}}]}, 3) == "a.0.b"
    # NOTE: far deeper than Python's recursion limit: the walk is iterative.
    deep: Any = 0
    for _ in range(100_000):
        deep = [deep]
    # the body is level 1 and "x" level 2: level 65 is 63 indexes into it
    path = too_deep({"x": deep}, 64)
    assert path == "x" + ".0" * 63


def test_counts_are_checked_per_field():
    limits = BodyLimits(max_messages=3, max_blocks=4, max_tools=2)
    check_counts({"messages": [{"content": "x"}] * 3}, limits)
    with pytest.raises(ApiError, match="messages: 4 entries, more than the 3"):
        check_counts({"messages": [{"content": "x"}] * 4}, limits)
    with pytest.raises(ApiError, match="tools: 3 entries"):
        check_counts({"messages": [], "tools": [{}] * 3}, limits)
    # system blocks, message blocks and a tool result's inner blocks all count
    body = {
        "system": [{"type": "text"}],
        "messages": [{"content": [{"type": "tool_result", "content": [{}, {}]}, {}]}],
    }
    with pytest.raises(ApiError, match="5 content blocks in all"):
        check_counts(body, limits)


# --------------------------------------------------------- through the gateway


def test_nan_in_a_tool_schema_or_tool_input_is_a_400(gateway_for):
    gw = gateway_for(Script())
    schema = b'{"type": "object", "properties": {"a": {"type": "number", "maximum": NaN}}}'
    raw = b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}],'
    raw = raw % MODEL.encode()
    body = raw + b' "tools": [{"name": "f", "input_schema": %s}]}' % schema
    assert "NaN" in refused(post(gw, body))
    assert "NaN" in refused(post(gw, body, "/v1/messages/count_tokens"))
    use = (
        b'{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "x"},'
        b' {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",'
        b' "input": {"v": Infinity}}]}, {"role": "user", "content": "y"}]}'
    ) % MODEL.encode()
    assert "Infinity" in refused(post(gw, use))


def test_a_deep_tool_schema_is_a_400_naming_its_path(gateway_for):
    """Before: ~950 deep made the chat template's tojson raise RecursionError (a 500)."""
    gw = gateway_for(Script(), max_json_depth=64)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        count = path.endswith("count_tokens")
        msg = refused(post(gw, deep_tool_body(400, count), path))
        assert msg.startswith("tools.0.input_schema.properties.a.properties.a")
        assert "nested more than 64 levels" in msg
        # Deeper than the C parser's own stack: still a 400 with the envelope.
        assert "nested" in refused(post(gw, deep_tool_body(950, count), path))
    # Within the limit the same shape is served (body 1, tools 2, tool 3, schema 4...).
    assert post(gw, deep_tool_body(25)).status_code == 200
    assert json.loads(deep_tool_body(3)) == tool_body(nested(3))


def test_an_idempotent_deep_body_is_a_400_not_a_500(gateway_for):
    """Before: depth 255 with an idempotency-key exceeded the fingerprint's model_dump."""
    gw = gateway_for(Script())
    r = post(gw, deep_tool_body(255), headers={"idempotency-key": "deep-1"})
    assert "nested more than" in refused(r)
    # and the key was never claimed: a valid body with it now runs
    ok = post(gw, tool_body(nested(10)), headers={"idempotency-key": "deep-1"})
    assert ok.status_code == 200, ok.text


def test_caps_on_messages_blocks_and_tools(gateway_for):
    gw = gateway_for(Script(), max_messages=10, max_content_blocks=20, max_tools=3)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(11)]
    assert "messages: 11 entries" in refused(post(gw, {**tool_body({}), "messages": turns}))
    blocks = [{"type": "text", "text": "x"}] * 21
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": blocks}]}
    assert "21 content blocks" in refused(post(gw, body))
    tools = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(4)]
    assert "tools: 4 entries" in refused(post(gw, {**tool_body({}), "tools": tools}))
    assert post(gw, {**body, "messages": [{"role": "user", "content": blocks[:20]}]}).is_success


def test_an_overlong_prompt_stops_tokenizing_and_says_so(gateway_for):
    gw = gateway_for(Script(), max_context_tokens=4096)
    # 3x the window of one-byte tokens: past the 2x count limit
    big = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 12_300}]}
    count = {"model": MODEL, "messages": big["messages"]}
    for path, body in (("/v1/messages", big), ("/v1/messages/count_tokens", count)):
        msg = refused(post(gw, body, path))
        assert msg.startswith("prompt is too long: at least ")
        assert "tokens > 4096 maximum" in msg
    # Up to 2x the window, the exact count and Anthropic's context-limit wording stay.
    fits = {**big, "messages": [{"role": "user", "content": "x" * 7000}]}
    n = post(gw, {**count, "messages": fits["messages"]}, "/v1/messages/count_tokens").json()[
        "input_tokens"
    ]
    assert 7000 < n <= 8192
    assert refused(post(gw, fits)).startswith(
        f"input length and `max_tokens` exceed context limit: {n} + 4 > 4096"
    )


def test_count_tokens_has_its_own_rate_limit_with_headers(gateway_for, caplog):
    caplog.set_level(logging.INFO, logger="cachepoint.requests")
    gw = gateway_for(Script(), org_count_tokens_per_minute=2)
    count = {"model": MODEL, "messages": MSGS}
    first = post(gw, count, "/v1/messages/count_tokens")
    assert first.status_code == 200
    assert first.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "1"
    assert post(gw, count, "/v1/messages/count_tokens").status_code == 200
    third = post(gw, count, "/v1/messages/count_tokens")
    assert third.status_code == 429
    assert third.json()["error"]["type"] == "rate_limit_error"
    assert "count_tokens requests per minute" in third.json()["error"]["message"]
    assert int(third.headers["retry-after"]) >= 1
    # Messages keep their own budget.
    assert post(gw, {"model": MODEL, "max_tokens": 4, "messages": MSGS}).status_code == 200
    # Each count is in the request log, the refused one with its org and error type.
    lines = [
        r.fields  # type: ignore[attr-defined]
        for r in caplog.records
        if r.name == "cachepoint.requests" and r.fields["path"].endswith("count_tokens")  # type: ignore[attr-defined]
    ]
    assert [(x["status"], x["error_type"]) for x in lines] == [
        (200, None),
        (200, None),
        (429, "rate_limit_error"),
    ]
    assert len({x["org"] for x in lines}) == 1 and lines[0]["org"]


def test_the_openapi_document_describes_the_bodies(gateway_for):
    gw = gateway_for(Script(), api_docs=True)
    doc = httpx.get(f"{gw.url}/openapi.json", timeout=10).json()
    for path, model in (
        ("/v1/messages", "MessagesRequest"),
        ("/v1/messages/count_tokens", "CountTokensRequest"),
    ):
        body = doc["paths"][path]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        assert body["required"] is True and schema["title"] == model
        assert "messages" in schema["required"]
    refs = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                refs.add(node["$ref"].rsplit("/", 1)[-1])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs and refs <= set(doc["components"]["schemas"])
