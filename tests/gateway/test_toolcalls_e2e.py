"""Tool calls end to end: a scripted replica replays fixed token texts, the official
SDK reads ``tool_use`` blocks from the gateway, collected and streamed."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import httpx
import pytest
from anthropic.types import TextBlock, ToolUseBlock

from .scripted import MODEL, Gateway, Script, gateway_factory

TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
]
MSGS = [{"role": "user", "content": "Weather in Paris, and the time?"}]
# Token texts as a model writes them: the tags are cut across token events.
CALLS = [
    "I'll check.",
    "\n<tool",
    "_call>\n",
    '{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}',
    "\n</tool_",
    "call>\n<",
    'tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "\n",
]
ID = re.compile(r"^toolu_[A-Za-z0-9]{24}$")


@pytest.fixture
def gateway_for(serve, tmp_path):
    return gateway_factory(serve, tmp_path)


def _shape(content: list[Any]) -> list[tuple[Any, ...]]:
    return [
        ("tool_use", b.name, b.input) if isinstance(b, ToolUseBlock) else ("text", b.text)
        for b in content
    ]


def _answer(client: Any, stream: bool, **kw: Any) -> Any:
    """The final message, collected (create) or streamed (stream's final message)."""
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        return s.get_final_message()


EXPECTED = [
    ("text", "I'll check.\n"),
    ("tool_use", "get_weather", {"city": "Paris"}),
    ("tool_use", "get_time", {}),
]


def test_create_returns_tool_use_blocks(gateway_for):
    gw: Gateway = gateway_for(Script(texts=CALLS, once=True, stop_reason="end_turn"))
    msg = gw.client().messages.create(model=MODEL, max_tokens=64, messages=MSGS, tools=TOOLS)
    assert _shape(msg.content) == EXPECTED
    assert isinstance(msg.content[0], TextBlock)
    ids = [b.id for b in msg.content if isinstance(b, ToolUseBlock)]
    assert all(ID.match(i) for i in ids) and len(set(ids)) == 2
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert msg.usage.output_tokens == len(CALLS)  # token events, not text
    assert [r.output_tokens for r in gw.wait_rows(1)] == [len(CALLS)]


def test_stream_yields_the_same_final_message(gateway_for):
    gw: Gateway = gateway_for(Script(texts=CALLS, once=True, stop_reason="end_turn"))
    client = gw.client()
    with client.messages.stream(model=MODEL, max_tokens=64, messages=MSGS, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _shape(final.content) == EXPECTED
    assert final.stop_reason == "tool_use" and final.stop_sequence is None
    assert final.usage.output_tokens == len(CALLS)
    assert all(ID.match(b.id) for b in final.content if isinstance(b, ToolUseBlock))
    starts = [e for e in events if e.type == "content_block_start"]
    stops = [e for e in events if e.type == "content_block_stop"]
    assert [e.index for e in starts] == [0, 1, 2] == [e.index for e in stops]
    assert [e.content_block.type for e in starts] == ["text", "tool_use", "tool_use"]
    assert all(e.content_block.input == {} for e in starts[1:])
    json_deltas = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert [json.loads(d) for d in json_deltas] == [{"city": "Paris"}, {}]
    # The streamed text never shows a piece of a tag.
    texts = [
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    ]
    assert "".join(texts) == "I'll check.\n" and not any("<" in t for t in texts)
    assert [r.output_tokens for r in gw.wait_rows(1)] == [len(CALLS)]

    # And the collected answer to the same request is the same message.
    collected = client.messages.create(model=MODEL, max_tokens=64, messages=MSGS, tools=TOOLS)
    assert _shape(collected.content) == _shape(final.content)
    assert collected.stop_reason == final.stop_reason
    assert collected.usage.output_tokens == final.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_and_no_tools_leave_the_text_alone(gateway_for, stream):
    gw: Gateway = gateway_for(Script(texts=CALLS, once=True, stop_reason="end_turn"))
    client = gw.client()
    for extra in ({"tools": TOOLS, "tool_choice": {"type": "none"}}, {}):
        kw: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": MSGS, **extra}
        msg = _answer(client, stream, **kw)
        assert _shape(msg.content) == [("text", "".join(CALLS))], extra
        assert msg.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_and_unknown_calls_are_text_not_errors(gateway_for, stream):
    texts = [
        "a <tool_call>",
        '{"name": "get_weather", "arguments": {"city": }}',
        "</tool_call> b <tool_call>",
        '{"name": "launch", "arguments": {}}</tool_call> c <tool_',
        "call>{never closed",
    ]
    gw: Gateway = gateway_for(Script(texts=texts, once=True, stop_reason="max_tokens"))
    client = gw.client()
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": MSGS, "tools": TOOLS}
    msg = _answer(client, stream, **kw)
    assert _shape(msg.content) == [("text", "".join(texts))]
    assert msg.stop_reason == "max_tokens"
    assert [r.output_tokens for r in gw.wait_rows(1)] == [len(texts)]


def test_a_keyed_tool_use_answer_replays_with_the_same_ids(gateway_for):
    script = Script(texts=CALLS, once=True, stop_reason="end_turn")
    gw: Gateway = gateway_for(script)
    headers = {
        "x-api-key": gw.keys["a"],
        "anthropic-version": "2023-06-01",
        "idempotency-key": str(uuid.uuid4()),
    }
    body = {"model": MODEL, "max_tokens": 64, "messages": MSGS, "tools": TOOLS}
    first = httpx.post(f"{gw.url}/v1/messages", json=body, headers=headers, timeout=30)
    again = httpx.post(f"{gw.url}/v1/messages", json=body, headers=headers, timeout=30)
    assert first.status_code == again.status_code == 200
    assert first.json()["stop_reason"] == "tool_use"
    assert again.content == first.content and script.calls == 1


FORCED_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {'


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_tool_starts_the_call_and_stops_at_its_end(gateway_for, stream):
    """The replica only finishes the arguments and is stopped at </tool_call>."""
    script = Script(
        texts=['"city"', ': "Paris"}}', "\n"],
        once=True,
        stop_reason="stop_sequence",
        stop_sequence="</tool_call>",
    )
    gw: Gateway = gateway_for(script)
    client = gw.client()
    choice = {"type": "tool", "name": "get_weather"}
    kw: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": MSGS,
        "tools": TOOLS,
        "tool_choice": choice,
    }
    msg = _answer(client, stream, **kw)
    assert _shape(msg.content) == [("tool_use", "get_weather", {"city": "Paris"})]
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    sent = script.bodies[-1]
    assert sent["stop_sequences"] == ["</tool_call>"]
    # The opening is the prompt's last tokens (the byte tokenizer: its UTF-8 bytes),
    # billed as input: the usage row counts it.
    opening = list(FORCED_WEATHER.encode())
    assert sent["token_ids"][-len(opening) :] == opening
    counted = client.messages.count_tokens(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice
    )
    assert counted.input_tokens == len(sent["token_ids"]) == msg.usage.input_tokens
    plain = client.messages.count_tokens(model=MODEL, messages=MSGS, tools=TOOLS)
    assert counted.input_tokens > plain.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_any_lets_the_model_name_the_tool(gateway_for, stream):
    script = Script(
        texts=['get_time", "arguments": {}}\n'],
        once=True,
        stop_reason="stop_sequence",
        stop_sequence="</tool_call>",
    )
    gw: Gateway = gateway_for(script)
    client = gw.client()
    kw: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": MSGS,
        "tools": TOOLS,
        "tool_choice": {"type": "any"},
        "stop_sequences": ["END"],
    }
    msg = _answer(client, stream, **kw)
    assert _shape(msg.content) == [("tool_use", "get_time", {})]
    assert msg.stop_reason == "tool_use"
    assert script.bodies[-1]["stop_sequences"] == ["END", "</tool_call>"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_the_model_botches_is_text(gateway_for, stream):
    """No call parses: the answer is the text, opening included, and ends as it ended."""
    script = Script(texts=["I would rather not."], once=True, stop_reason="end_turn")
    gw: Gateway = gateway_for(script)
    client = gw.client()
    kw: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": MSGS,
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    msg = _answer(client, stream, **kw)
    assert _shape(msg.content) == [("text", FORCED_WEATHER + "I would rather not.")]
    assert msg.stop_reason == "end_turn"


def test_a_tool_choice_that_cannot_be_honoured_is_a_400(gateway_for):
    gw: Gateway = gateway_for(Script(texts=CALLS, once=True))
    headers = {"x-api-key": gw.keys["a"], "anthropic-version": "2023-06-01"}
    bad = [
        ({"tool_choice": {"type": "any"}}, "needs at least one tool"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "launch"}}, "'launch'"),
    ]
    for extra, words in bad:
        body = {"model": MODEL, "messages": MSGS, **extra}
        for path, more in (("/v1/messages", {"max_tokens": 8}), ("/v1/messages/count_tokens", {})):
            r = httpx.post(f"{gw.url}{path}", json={**body, **more}, headers=headers, timeout=30)
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and words in err["message"]


def test_the_sdks_own_answer_can_be_sent_back(gateway_for):
    """A client replays the assistant turn as the SDK gave it: as its objects, or as
    their model_dump(), which adds caller and toolset_name (null)."""
    gw: Gateway = gateway_for(Script(texts=CALLS, once=True, stop_reason="end_turn"))
    client = gw.client()
    msg = client.messages.create(model=MODEL, max_tokens=64, messages=MSGS, tools=TOOLS)
    uses = [b for b in msg.content if isinstance(b, ToolUseBlock)]
    dumped = [b.model_dump() for b in msg.content]
    assert "caller" in dumped[1] and "toolset_name" in dumped[1]
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses]
    for replay in (msg.content, dumped):
        follow = [
            *MSGS,
            {"role": "assistant", "content": replay},
            {"role": "user", "content": results},
        ]
        again = client.messages.create(model=MODEL, max_tokens=64, messages=follow, tools=TOOLS)
        assert again.stop_reason == "tool_use"
    # A caller is an object with a type; anything else is still refused.
    headers = {"x-api-key": gw.keys["a"], "anthropic-version": "2023-06-01"}
    dumped[1]["caller"] = "me"
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [*MSGS, {"role": "assistant", "content": dumped}],
    }
    r = httpx.post(f"{gw.url}/v1/messages", json=body, headers=headers, timeout=30)
    assert r.status_code == 400 and "caller" in r.json()["error"]["message"]
