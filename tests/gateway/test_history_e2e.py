"""History features end to end, through the official SDK: context_management in the
JSON answer and the stream, the cachepoint-degraded header, deferred tools in the
tool-call parser (scripted replica), and what clearing tool uses does to the cache
(a real tiny replica, real cache accounting)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from anthropic.types.beta import BetaToolUseBlock

from cachepoint.gateway.contract.context_edits import CLEARED_RESULT
from cachepoint.gateway.contract.render import Renderer
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.tokenizer import ByteTokenizer

from .scripted import MODEL, Gateway, Script, gateway_factory

BETA = ["context-management-2025-06-27"]
TOOLS = [{"name": "read", "input_schema": {"type": "object", "properties": {"p": {}}}}]
BODY = 200
PNG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}


def history(uses: int, image: bool = False) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Read the files."}]
    for i in range(uses):
        tid = f"toolu_{i}"
        msgs.append(
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": tid, "name": "read", "input": {"p": i}}],
            }
        )
        content: list[dict[str, Any]] = [{"type": "text", "text": str(i) * BODY}]
        if image and i == 0:
            content.append(PNG)
        msgs.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tid, "content": content}],
            }
        )
    return msgs


CLEAR = {
    "edits": [
        {
            "type": "clear_tool_uses_20250919",
            "trigger": {"type": "input_tokens", "value": 100},
            "keep": {"type": "tool_uses", "value": 1},
        }
    ]
}


@pytest.fixture
def gateway_for(serve, tmp_path):
    return gateway_factory(serve, tmp_path)


def _sent_text(script: Script) -> str:
    return ByteTokenizer().decode(script.bodies[-1]["token_ids"])


def test_json_answer_reports_applied_edits_and_degraded_images(gateway_for):
    script = Script(texts=["ok"], once=True, stop_reason="end_turn")
    gw: Gateway = gateway_for(script)
    raw = gw.client().beta.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=8,
        tools=TOOLS,
        messages=history(3, image=True),
        context_management=CLEAR,
        betas=BETA,
    )
    assert raw.headers["cachepoint-degraded"] == "images"
    msg = raw.parse()
    (edit,) = msg.context_management.applied_edits
    assert edit.type == "clear_tool_uses_20250919"
    assert edit.cleared_tool_uses == 2
    # Uses 0 and 1 lose their text and (use 0) its image placeholder.
    image = len("\n[image image/png sha256:") + 32 + len("]")
    assert edit.cleared_input_tokens == 2 * (BODY - len(CLEARED_RESULT)) + image
    sent = _sent_text(script)
    assert sent.count(CLEARED_RESULT) == 2 and "2" * BODY in sent and "0" * BODY not in sent


def test_stream_reports_applied_edits_in_the_final_message_delta(gateway_for):
    gw: Gateway = gateway_for(Script(texts=["o", "k"], once=True, stop_reason="end_turn"))
    with gw.client().beta.messages.stream(
        model=MODEL,
        max_tokens=8,
        tools=TOOLS,
        messages=history(3, image=True),
        context_management=CLEAR,
        betas=BETA,
    ) as stream:
        assert stream.response.headers["cachepoint-degraded"] == "images"
        deltas = [e for e in stream if e.type == "message_delta"]
        final = stream.get_final_message()
    (delta,) = deltas
    assert [e.cleared_tool_uses for e in delta.context_management.applied_edits] == [2]
    assert final.context_management == delta.context_management


def test_forced_tool_choice_keeps_the_report(gateway_for):
    """tool_choice any ends the prompt with a call's opening: the edits still report."""
    script = Script(texts=['"read", "arguments": {}}\n'], once=True, stop_reason="end_turn")
    gw: Gateway = gateway_for(script)
    msg = gw.client().beta.messages.create(
        model=MODEL,
        max_tokens=16,
        tools=TOOLS,
        tool_choice={"type": "any"},
        messages=history(3),
        context_management=CLEAR,
        betas=BETA,
    )
    assert [e.cleared_tool_uses for e in msg.context_management.applied_edits] == [2]
    assert _sent_text(script).count(CLEARED_RESULT) == 2


def test_without_context_management_the_answer_has_no_such_field(gateway_for):
    gw: Gateway = gateway_for(Script(texts=["ok"], once=True, stop_reason="end_turn"))
    client = gw.client()
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=8, tools=TOOLS, messages=history(3)
    )
    assert "context_management" not in raw.http_response.json()
    assert "cachepoint-degraded" not in raw.headers
    # Asked for, and nothing applied: an empty list, as Anthropic answers.
    raw = client.beta.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=8,
        tools=TOOLS,
        messages=history(3),
        context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
        betas=BETA,
    )
    assert raw.http_response.json()["context_management"] == {"applied_edits": []}
    with client.beta.messages.stream(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": "hi"}],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        betas=BETA,
    ) as stream:
        (delta,) = [e for e in stream if e.type == "message_delta"]
    assert delta.context_management.applied_edits == []


def test_bad_edit_order_is_a_400_naming_the_path(gateway_for):
    gw: Gateway = gateway_for(Script())
    with pytest.raises(anthropic.BadRequestError, match=r"context_management\.edits\.1: "):
        gw.client().beta.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            context_management={
                "edits": [
                    {"type": "clear_tool_uses_20250919"},
                    {"type": "clear_thinking_20251015"},
                ]
            },
            betas=BETA,
        )
    assert gw.rows() == []


WEATHER = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "defer_loading": True,
}
SEARCH = {"name": "ToolSearch", "input_schema": {"type": "object", "properties": {"q": {}}}}
CALL = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']
FOUND = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_s", "name": "ToolSearch", "input": {}}],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_s",
                "content": [{"type": "tool_reference", "tool_name": "get_weather"}],
            }
        ],
    },
]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_deferred_tool_is_callable_only_once_referenced(gateway_for, stream):
    gw: Gateway = gateway_for(Script(texts=CALL, once=True, stop_reason="end_turn"))
    client = gw.client()

    def answer(messages: list[dict[str, Any]]) -> Any:
        kw: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 64,
            "tools": [SEARCH, WEATHER],
            "messages": messages,
            "betas": ["advanced-tool-use-2025-11-20"],
        }
        if not stream:
            return client.beta.messages.create(**kw)
        with client.beta.messages.stream(**kw) as s:
            return s.get_final_message()

    before = answer(FOUND[:1])
    assert [b.type for b in before.content] == ["text"]
    assert before.content[0].text == CALL[0] and before.stop_reason == "end_turn"
    after = answer(FOUND)
    (call,) = after.content
    assert isinstance(call, BetaToolUseBlock)
    assert (call.name, call.input, after.stop_reason) == (
        "get_weather",
        {"city": "Paris"},
        "tool_use",
    )


# ------------------------------------------------------------------ the cache, for real

SYSTEM = "You are a careful coding agent. Read before you write. " * 3
EPH = {"type": "ephemeral"}


def _turn(messages: list[dict[str, Any]], trigger: int) -> dict[str, Any]:
    """A Claude Code shaped request: breakpoints on the system prompt and on the
    newest user block, and the same clearing rule every turn."""
    msgs = [dict(m) for m in messages]
    last = dict(msgs[-1])
    blocks = [dict(b) for b in last["content"]]
    blocks[-1]["cache_control"] = EPH
    msgs[-1] = last | {"content": blocks}
    return {
        "model": MODEL,
        "max_tokens": 4,
        "system": [{"type": "text", "text": SYSTEM, "cache_control": EPH}],
        "tools": TOOLS,
        "messages": msgs,
        "context_management": {
            "edits": [
                {
                    "type": "clear_tool_uses_20250919",
                    "trigger": {"type": "input_tokens", "value": trigger},
                    "keep": {"type": "tool_uses", "value": 2},
                }
            ]
        },
    }


def _breakpoint_end(body: dict[str, Any]) -> int:
    """The prompt up to its last breakpoint: every token but the generation header."""
    return len(Renderer(ByteTokenizer()).render(MessagesRequest.model_validate(body))) - 1


def _buckets(msg: Any) -> tuple[int, int]:
    return msg.usage.cache_read_input_tokens, msg.usage.cache_creation_input_tokens


def test_clearing_tool_uses_reads_the_prefix_before_the_first_cleared_block(stack):
    """Turn 1 is under the trigger. Turn 2 passes it and clears the two oldest results:
    its prompt equals turn 1's only up to the first cleared block, so it reads the
    system breakpoint's entry and writes everything after it again. Turn 3 clears the
    same blocks: it reads all of turn 2's entry and writes only what is new."""
    client = anthropic.Anthropic(base_url=stack["url"], api_key=stack["keys"]["a"], max_retries=0)
    t1 = history(3)
    t2 = history(4)
    t3 = [
        *t2,
        {"role": "assistant", "content": [{"type": "text", "text": "All read."}]},
        {"role": "user", "content": [{"type": "text", "text": "Summarise them."}]},
    ]
    trigger = _breakpoint_end(_turn(t1, 10**6)) + 1  # turn 1's prompt, exactly
    # The first breakpoint: the tools, then the system prompt (render order).
    first = Renderer(ByteTokenizer()).render(MessagesRequest.model_validate(_turn(t1, trigger)))
    p_system = next(s.end for s in first.blocks if s.path == "system.0")
    assert p_system == 1 + sum(1 + len(json.dumps(t, separators=(",", ":"))) + 1 for t in TOOLS) + (
        1 + len(SYSTEM) + 1
    )  # <|bos|>; each tool: header, its JSON, <|sep|>; the system: header, text, <|sep|>

    def send(messages: list[dict[str, Any]]) -> tuple[Any, int]:
        body = _turn(messages, trigger)
        msg = client.beta.messages.create(**body, betas=BETA)
        return msg, _breakpoint_end(body)

    r1, p1 = send(t1)
    assert r1.context_management.applied_edits == []
    assert _buckets(r1) == (0, p1)
    r2, p2 = send(t2)
    (edit,) = r2.context_management.applied_edits
    assert (edit.cleared_tool_uses, edit.cleared_input_tokens) == (
        2,
        2 * (BODY - len(CLEARED_RESULT)),
    )
    assert _buckets(r2) == (p_system, p2 - p_system)  # turn 1's entry at p1 no longer matches
    r3, p3 = send(t3)
    assert r3.context_management.applied_edits[0].cleared_tool_uses == 2
    assert _buckets(r3) == (p2, p3 - p2)
