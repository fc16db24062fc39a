"""What the renderer makes of history features real clients send: replayed thinking,
deferred tools and their ``tool_reference`` blocks, images and documents. Each through
the canonical renderer (byte tokenizer) and SmolLM2's chat template."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cachepoint.gateway.contract.deferred import definition_text
from cachepoint.gateway.contract.render import Renderer, degraded, degraded_headers
from cachepoint.gateway.contract.template import build_renderer
from cachepoint.gateway.contract.toolcalls import offered
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.replica.model_source import preset_path
from cachepoint.tokenizer import ByteTokenizer

from .plans import last_breakpoint, plan_of

CANONICAL = Renderer(ByteTokenizer())
TEMPLATE = build_renderer(preset_path("smollm2"))
RENDERERS = pytest.mark.parametrize("r", [CANONICAL, TEMPLATE], ids=["canonical", "smollm2"])
EPH = {"type": "ephemeral"}


def _last_breakpoint(r: Any, req: MessagesRequest) -> tuple[Any, int]:
    return last_breakpoint(r, req)


def _turns(session: list[dict[str, Any]], n: int, **body: Any) -> MessagesRequest:
    """The request for user turn ``n`` (0-based): the history so far, the breakpoint on
    the system prompt and on the newest user turn's last block (Claude Code's layout)."""
    msgs = copy.deepcopy(session[: 2 * n + 1])
    msgs[-1]["content"][-1]["cache_control"] = EPH
    return MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "You are terse.", "cache_control": EPH}],
            "messages": msgs,
            **body,
        }
    )


def _assert_prefix_holds(r: Any, session: list[dict[str, Any]], **body: Any) -> None:
    prev, prev_bp = _last_breakpoint(r, _turns(session, 0, **body))
    for n in range(1, len(session) // 2 + 1):
        cur, cur_bp = _last_breakpoint(r, _turns(session, n, **body))
        assert list(cur.tokens[:prev_bp]) == list(prev.tokens[:prev_bp]), f"turn {n}"
        assert prev_bp in {s.end for s in cur.blocks}
        assert cur_bp > prev_bp
        prev, prev_bp = cur, cur_bp


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


# ------------------------------------------------------------------ thinking

THINKING_SESSION: list[dict[str, Any]] = [
    _user("Which file defines main?"),
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Look for main.", "signature": "c2ln"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "grep", "input": {"q": "main"}},
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "app.py:1"}],
    },
    {
        "role": "assistant",
        "content": [
            {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
            {"type": "thinking", "thinking": "", "signature": "b21pdHRlZA=="},  # display: omitted
            {"type": "text", "text": "app.py defines it."},
        ],
    },
    _user("Thanks. And tests?"),
    {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "Only thinking.", "signature": "eA=="}],
    },
    _user("Well?"),
]
GREP = [{"name": "grep", "input_schema": {"type": "object", "properties": {"q": {}}}}]


@RENDERERS
@pytest.mark.parametrize(
    "edits",
    [
        None,
        [{"type": "clear_thinking_20251015", "keep": "all"}],  # Claude Code's
        [{"type": "clear_thinking_20251015"}],  # the default: the last turn's thinking
    ],
    ids=["no-edit", "keep-all", "keep-1"],
)
def test_replayed_thinking_keeps_the_prefix_across_turns(r, edits):
    """Turn n+1 starts with exactly turn n's tokens up to turn n's last breakpoint,
    whatever thinking the history replays and however clear_thinking trims it."""
    body: dict[str, Any] = {"tools": GREP}
    if edits is not None:
        body["context_management"] = {"edits": edits}
    _assert_prefix_holds(r, THINKING_SESSION, **body)


def _strip_thinking(session: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(session)
    for msg in out:
        msg["content"] = [b for b in msg["content"] if "thinking" not in b["type"]]
        if not msg["content"]:
            msg["content"] = [{"type": "text", "text": ""}]
    return out


@RENDERERS
def test_thinking_never_reaches_the_prompt(r):
    """The served models have no reasoning mode: replayed thinking is dropped, so a
    client that keeps it and one that strips it send the same prompt."""
    req = _turns(THINKING_SESSION, 2, tools=GREP)
    out = r.render(req)
    text = r.tokenizer.decode(out.tokens.tolist())
    for hidden in ("Look for main.", "Only thinking.", "ZW5jcnlwdGVk", "thinking"):
        assert hidden not in text
    plain = r.render(_turns(_strip_thinking(THINKING_SESSION), 2, tools=GREP))
    spans = {s.path: s for s in out.blocks}
    assert spans["messages.1.content.0"].start == spans["messages.1.content.0"].end
    assert spans["messages.1.content.0"].kind == "thinking"
    assert not spans["messages.1.content.0"].cacheable
    assert list(out.tokens) == list(plain.tokens)


# ------------------------------------------------------------------ deferred tools

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "defer_loading": True,
}
SEARCH = {"name": "ToolSearch", "input_schema": {"type": "object", "properties": {"q": {}}}}
DEFERRED_SESSION: list[dict[str, Any]] = [
    _user("Weather in Paris?"),
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_s", "name": "ToolSearch", "input": {"q": "weather"}}
        ],
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
    {
        "role": "assistant",
        "content": [
            {"type": "tool_use", "id": "toolu_w", "name": "get_weather", "input": {"city": "Paris"}}
        ],
    },
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_w", "content": "sunny"}],
    },
]


@RENDERERS
def test_deferred_tools_stay_out_of_the_tools_section(r):
    with_deferred = _turns(DEFERRED_SESSION, 0, tools=[SEARCH, WEATHER])
    without = _turns(DEFERRED_SESSION, 0, tools=[SEARCH])
    out = r.render(with_deferred)
    assert list(out.tokens) == list(r.render(without).tokens)
    span = next(s for s in out.blocks if s.path == "tools.1")
    assert span.start == span.end  # where it stands, empty
    assert "get_weather" not in r.tokenizer.decode(out.tokens.tolist())


@RENDERERS
def test_a_tool_reference_loads_the_definition_where_it_stands(r):
    req = _turns(DEFERRED_SESSION, 1, tools=[SEARCH, WEATHER])
    text = r.tokenizer.decode(r.render(req).tokens.tolist())
    tool = req.tools[1]
    assert definition_text(tool) in text
    assert text.count('"The weather in a city."') == 1  # inline only, not in the tools


@RENDERERS
def test_loading_a_deferred_tool_keeps_the_prefix(r):
    """The turn that finds a tool reads everything the turn before it wrote: the tools
    section never changes, the definition arrives inside the search's tool_result."""
    _assert_prefix_holds(r, DEFERRED_SESSION, tools=[SEARCH, WEATHER])


def test_deferred_tools_are_callable_once_the_history_loads_them():
    def names(msgs: list[dict[str, Any]]) -> frozenset[str] | None:
        req = MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 8, "tools": [SEARCH, WEATHER], "messages": msgs}
        )
        return offered(req)

    assert names(DEFERRED_SESSION[:1]) == {"ToolSearch"}
    assert names(DEFERRED_SESSION[:3]) == {"ToolSearch", "get_weather"}  # a tool_reference
    called = [DEFERRED_SESSION[0], DEFERRED_SESSION[3], DEFERRED_SESSION[4]]
    assert names(called) == {"ToolSearch", "get_weather"}  # a tool_use of it


def test_a_breakpoint_on_a_deferred_tool_caches_the_tools_before_it():
    tools = [SEARCH, dict(WEATHER, cache_control=EPH)]
    req = _turns(DEFERRED_SESSION, 0, tools=tools)
    out = CANONICAL.render(req)
    spans = {s.path: s for s in out.blocks}
    assert spans["tools.1"].end == spans["tools.0"].end
    plan = plan_of(out)
    assert plan.breakpoints[0].position == spans["tools.0"].end


# ------------------------------------------------------------------ images, documents

PNG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
PDF = {
    "type": "document",
    "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"},
}
TXT = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "hi"}}


def _with(*blocks: dict[str, Any], in_result: bool) -> MessagesRequest:
    msgs: list[dict[str, Any]] = [
        _user("read it"),
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "grep", "input": {}}],
        },
    ]
    if in_result:
        result = {"type": "tool_result", "tool_use_id": "t", "content": list(blocks)}
        msgs.append({"role": "user", "content": [result]})
    else:
        msgs.append({"role": "user", "content": [*blocks, {"type": "text", "text": "q"}]})
    return MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "tools": GREP, "messages": msgs}
    )


@pytest.mark.parametrize("in_result", [False, True], ids=["history", "tool_result"])
def test_images_and_documents_render_as_placeholders_and_are_named(in_result):
    req = _with(PNG, PDF, TXT, in_result=in_result)
    assert degraded(req) == ("images", "documents")
    assert degraded_headers(req) == {"cachepoint-degraded": "images,documents"}
    for r in (CANONICAL, TEMPLATE):
        text = r.tokenizer.decode(r.render(req).tokens.tolist())
        assert "[image image/png sha256:" in text and "iVBO" not in text
        assert "[document] application/pdf sha256:" in text and "JVBE" not in text
    assert degraded(_with(PNG, in_result=in_result)) == ("images",)
    # A text document is rendered in full: nothing degraded.
    assert degraded(_with(TXT, in_result=in_result)) == ()
    assert degraded_headers(_with(TXT, in_result=in_result)) == {}
