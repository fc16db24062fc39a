"""What real clients send: Claude Code 2.1.328's betas, `?beta=true`, and its
request fields (`thinking`, `context_management`, deferred tools, `tool_reference`),
accepted against a scripted replica; what a self-hosted model cannot do refused with
its path; context overflow in Anthropic's exact words, or clamped."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .scripted import MODEL, Gateway, Script, gateway_factory

# Claude Code 2.1.328's header, as captured (without --model it adds
# per-turn-control-2026-07-01).
CLAUDE_CODE_BETAS = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
    "per-turn-control-2026-07-01,mid-conversation-tool-changes-2026-07-01,"
    "thinking-token-count-2026-05-13,advanced-tool-use-2025-11-20,effort-2025-11-24"
)
UNKNOWN = "not-a-beta-2099-01-01"
IGNORED = "cachepoint-ignored-betas"
MSGS = [{"role": "user", "content": "hi"}]
TOOL = {"name": "Read", "input_schema": {"type": "object", "properties": {}}}


@pytest.fixture
def gateway_for(serve, tmp_path):
    return gateway_factory(serve, tmp_path)


def _script() -> Script:
    return Script(texts=["Hel", "lo"], once=True, stop_reason="end_turn")


def post(
    gw: Gateway,
    body: dict[str, Any],
    betas: str | None = None,
    path: str = "/v1/messages",
    query: str = "",
) -> httpx.Response:
    headers = {"x-api-key": gw.keys["a"], "anthropic-version": "2023-06-01"}
    if betas is not None:
        headers["anthropic-beta"] = betas
    return httpx.post(f"{gw.url}{path}{query}", json=body, headers=headers, timeout=30)


def ask(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": MSGS, **fields}


def error_of(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["message"])


def sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


# ------------------------------------------------------------------------ betas


def test_claude_code_betas_are_accepted_and_unknown_ones_named(gateway_for):
    gw: Gateway = gateway_for(_script())
    r = post(gw, ask(), CLAUDE_CODE_BETAS)
    assert r.status_code == 200, r.text
    assert IGNORED not in r.headers  # all of them are known no-ops
    r = post(gw, ask(), f"{CLAUDE_CODE_BETAS},{UNKNOWN},zz-other")
    assert r.status_code == 200, r.text
    assert r.headers[IGNORED] == f"{UNKNOWN},zz-other"
    # On a stream too, and on count_tokens.
    r = post(gw, ask(stream=True), f"{UNKNOWN},{CLAUDE_CODE_BETAS}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers[IGNORED] == UNKNOWN
    assert sse_events(r)[-1]["type"] == "message_stop"
    body = {"model": MODEL, "messages": MSGS}
    r = post(gw, body, UNKNOWN, "/v1/messages/count_tokens")
    assert r.status_code == 200 and r.headers[IGNORED] == UNKNOWN


def test_strict_betas_refuses_unknown_ones_only(gateway_for):
    gw: Gateway = gateway_for(_script(), strict_betas=True)
    assert error_of(post(gw, ask(), UNKNOWN)) == f"Unsupported beta header: {UNKNOWN}"
    r = post(gw, ask(), f"{CLAUDE_CODE_BETAS},prompt-caching-scope-2026-01-05")
    assert r.status_code == 200, r.text
    # The scope beta is exact: a family prefix does not stand in for it.
    msg = error_of(post(gw, ask(), "prompt-caching-scope-2099-01-01"))
    assert msg == "Unsupported beta header: prompt-caching-scope-2099-01-01"


def test_noop_betas_leave_the_cache_key_and_cache_betas_change_it(gateway_for):
    script = _script()
    gw: Gateway = gateway_for(script, min_cacheable_tokens=0)
    marked = [{"type": "text", "text": "x" * 64, "cache_control": {"type": "ephemeral"}}]
    for betas in (None, "claude-code-20250219,effort-2025-11-24", CLAUDE_CODE_BETAS):
        assert post(gw, ask(system=marked), betas).status_code == 200
    keys = [[bp["extra_keys"] for bp in b["breakpoints"]] for b in script.bodies]
    assert keys[0] == keys[1]  # no-op betas: the same cache
    assert keys[2] != keys[0]  # interleaved-thinking is a cache-key beta
    assert any("beta:interleaved-thinking-2025-05-14" in k for k in keys[2][0])


def test_beta_query_parameter_on_every_endpoint(gateway_for):
    gw: Gateway = gateway_for(_script())
    assert post(gw, ask(), CLAUDE_CODE_BETAS, query="?beta=true").status_code == 200
    r = post(gw, ask(stream=True), CLAUDE_CODE_BETAS, query="?beta=true")
    assert r.status_code == 200 and sse_events(r)[-1]["type"] == "message_stop"
    body = {"model": MODEL, "messages": MSGS}
    r = post(gw, body, CLAUDE_CODE_BETAS, "/v1/messages/count_tokens", "?beta=true")
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    headers = {"x-api-key": gw.keys["a"]}
    r = httpx.get(f"{gw.url}/v1/models?beta=true", headers=headers)
    assert r.status_code == 200 and MODEL in [m["id"] for m in r.json()["data"]]
    r = httpx.get(f"{gw.url}/v1/models/{MODEL}?beta=true", headers=headers)
    assert r.status_code == 200 and r.json()["id"] == MODEL


# --------------------------------------------------------------------- thinking


def test_thinking_shapes(gateway_for):
    script = _script()
    gw: Gateway = gateway_for(script)
    for thinking in (
        {"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
        {"type": "adaptive"},
        {"type": "disabled"},
    ):
        r = post(gw, ask(max_tokens=2048, thinking=thinking))
        assert r.status_code == 200, (thinking, r.text)
        # No reasoning mode: the answer has no thinking blocks.
        assert [b["type"] for b in r.json()["content"]] == ["text"]
    too_small = {"type": "enabled", "budget_tokens": 1000}
    assert error_of(post(gw, ask(max_tokens=2048, thinking=too_small))) == (
        "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
    )
    over = {"type": "enabled", "budget_tokens": 4096}
    msg = error_of(post(gw, ask(max_tokens=4096, thinking=over)))
    assert msg.startswith("`max_tokens` must be greater than `thinking.budget_tokens`.")
    assert "thinking" in error_of(post(gw, ask(thinking={"type": "deep"})))
    assert "display" in error_of(
        post(gw, ask(thinking={"type": "enabled", "budget_tokens": 2000, "display": "x"}))
    )
    # Interleaved thinking lets the budget pass max_tokens; max_tokens is sent as asked.
    r = post(gw, ask(max_tokens=64, thinking=over), "interleaved-thinking-2025-05-14")
    assert r.status_code == 200, r.text
    assert script.bodies[-1]["max_tokens"] == 64


# ----------------------------------------------------------- context management


def test_context_management_shapes(gateway_for):
    gw: Gateway = gateway_for(_script())
    valid = [
        {"edits": []},
        {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "all"}}]},
        {
            "edits": [
                {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}},
                {
                    "type": "clear_tool_uses_20250919",
                    "trigger": {"type": "input_tokens", "value": 30000},
                    "keep": {"type": "tool_uses", "value": 3},
                    "clear_at_least": {"type": "input_tokens", "value": 5000},
                    "exclude_tools": ["Edit"],
                    "clear_tool_inputs": ["Bash"],
                },
            ]
        },
        {
            "edits": [
                {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 5}}
            ]
        },
    ]
    for cm in valid:
        r = post(gw, ask(context_management=cm), "context-management-2025-06-27")
        assert r.status_code == 200, (cm, r.text)
    invalid = [
        ({"edits": [{"type": "compact_20260112"}]}, "context_management.edits.0"),
        (
            {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns"}}]},
            "context_management.edits.0.clear_thinking_20251015.keep",
        ),
        (
            {
                "edits": [
                    {"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": -1}}
                ]
            },
            "context_management.edits.0.clear_tool_uses_20250919.keep.value",
        ),
        (
            {
                "edits": [
                    {
                        "type": "clear_tool_uses_20250919",
                        "trigger": {"type": "messages", "value": 3},
                    }
                ]
            },
            "context_management.edits.0.clear_tool_uses_20250919.trigger",
        ),
        (
            {"edits": [{"type": "clear_tool_uses_20250919", "bogus": 1}]},
            "context_management.edits.0.clear_tool_uses_20250919.bogus",
        ),
        (
            {"edits": [{"type": "clear_thinking_20251015"}, {"type": "clear_thinking_20251015"}]},
            "clear_thinking_20251015 appears more than once in edits",
        ),
        ({"edits": "all"}, "context_management.edits"),
    ]
    for cm, fragment in invalid:
        assert fragment in error_of(post(gw, ask(context_management=cm))), cm


# ------------------------------------------------------------------------ tools


def test_deferred_tools_and_tool_reference_are_accepted(gateway_for):
    gw: Gateway = gateway_for(_script())
    tools = [
        TOOL,
        {"type": "custom", "name": "mcp__x__y", "input_schema": {}, "defer_loading": True},
        {"name": "ToolSearch", "input_schema": {}, "defer_loading": False},
    ]
    r = post(gw, ask(tools=tools), CLAUDE_CODE_BETAS)
    assert r.status_code == 200, r.text
    assert "tools.0.defer_loading" in error_of(
        post(gw, ask(tools=[{**TOOL, "defer_loading": "yes"}]))
    )
    history = [
        {"role": "user", "content": "find the x tool"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"q": "x"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "tool_reference", "tool_name": "mcp__x__y"}],
                }
            ],
        },
    ]
    r = post(gw, ask(tools=tools, messages=history), CLAUDE_CODE_BETAS)
    assert r.status_code == 200, r.text
    bad = [{**history[2]["content"][0], "content": [{"type": "tool_reference"}]}]
    msg = error_of(
        post(gw, ask(tools=tools, messages=[*history[:2], {"role": "user", "content": bad}]))
    )
    assert "tool_reference.tool_name: Field required" in msg


def test_what_a_self_hosted_model_cannot_do_is_refused_with_its_path(gateway_for):
    gw: Gateway = gateway_for(_script())
    server = [
        ("web_search_20250305", {"name": "web_search", "max_uses": 5}),
        ("bash_20250124", {"name": "bash"}),
        ("text_editor_20250728", {"name": "str_replace_based_edit_tool"}),
        ("code_execution_20250825", {"name": "code_execution"}),
        ("computer_20250124", {"name": "computer", "display_width_px": 1024}),
        ("web_fetch_20250910", {"name": "web_fetch"}),
        ("memory_20250818", {"name": "memory"}),
    ]
    for kind, extra in server:
        tools = [TOOL, TOOL, TOOL, {"type": kind, **extra}]
        assert error_of(post(gw, ask(tools=tools))) == (
            f"tools.3: server tool {kind} is not available on a self-hosted model"
        )
    search = {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}
    msg = error_of(post(gw, ask(tools=[search, {**TOOL, "defer_loading": True}])))
    assert msg.startswith("tools.0: server tool tool_search_tool_regex_20251119 is not available")
    assert "tool_reference" in msg  # how to do it instead
    mcp = [{"type": "url", "url": "https://mcp.example/sse", "name": "x"}]
    assert error_of(post(gw, ask(mcp_servers=mcp))) == (
        "mcp_servers: MCP servers are not available on a self-hosted model"
    )
    assert error_of(post(gw, ask(container="container_1"))) == (
        "container: containers are not available on a self-hosted model"
    )
    body = {"model": MODEL, "messages": MSGS, "mcp_servers": mcp}
    assert error_of(post(gw, body, path="/v1/messages/count_tokens")).startswith("mcp_servers:")
    # service_tier is accepted (one tier here); an unknown tier is not.
    for tier in ("auto", "standard_only"):
        assert post(gw, ask(service_tier=tier)).status_code == 200
    assert error_of(post(gw, ask(service_tier="priority"))).startswith("service_tier:")
    # Top-level unknown fields are still refused, with their path.
    assert error_of(post(gw, ask(bogus=1))) == "bogus: Extra inputs are not permitted"


def test_metadata_user_id_takes_claude_codes_json_string(gateway_for):
    gw: Gateway = gateway_for(_script())
    user_id = json.dumps(
        {
            "device_id": "d" * 64,
            "account_uuid": "00000000-0000-4000-8000-000000000000",
            "session_id": "11111111-1111-4111-8111-111111111111",
            "extra": "e" * 120,
        }
    )
    assert 256 < len(user_id) <= 512
    assert post(gw, ask(metadata={"user_id": user_id})).status_code == 200
    assert "metadata.user_id" in error_of(post(gw, ask(metadata={"user_id": "u" * 513})))


# ------------------------------------------------------------- context overflow


def test_overflow_uses_anthropics_wording(gateway_for):
    script = _script()
    gw: Gateway = gateway_for(script, max_context_tokens=4096)
    n = post(gw, {"model": MODEL, "messages": MSGS}, path="/v1/messages/count_tokens").json()[
        "input_tokens"
    ]
    assert error_of(post(gw, ask(max_tokens=4096))) == (
        f"input length and `max_tokens` exceed context limit: {n} + 4096 > 4096, "
        "decrease input length or `max_tokens` and try again"
    )
    assert post(gw, ask(max_tokens=4096 - n)).status_code == 200
    assert script.bodies[-1]["max_tokens"] == 4096 - n


def test_clamp_max_tokens_lowers_it_to_the_room_left(gateway_for):
    script = _script()
    gw: Gateway = gateway_for(script, max_context_tokens=4096, clamp_max_tokens=True)
    n = post(gw, {"model": MODEL, "messages": MSGS}, path="/v1/messages/count_tokens").json()[
        "input_tokens"
    ]
    r = post(gw, ask(max_tokens=32000))
    assert r.status_code == 200, r.text
    assert script.bodies[-1]["max_tokens"] == 4096 - n
    # A prompt that fills the window alone is still refused, in the same words.
    big = [{"role": "user", "content": "x" * 5000}]
    count = {"model": MODEL, "messages": big}
    m = post(gw, count, path="/v1/messages/count_tokens").json()["input_tokens"]
    assert m >= 4096
    assert error_of(post(gw, ask(max_tokens=10, messages=big))) == (
        f"input length and `max_tokens` exceed context limit: {m} + 10 > 4096, "
        "decrease input length or `max_tokens` and try again"
    )


# --------------------------------------------------------- a Claude Code request


def claude_code_body() -> dict[str, Any]:
    """Shaped as Claude Code 2.1.328 sends its first turn, scaled down."""
    tools = [
        {
            "name": name,
            "description": f"The {name} tool. " + "Use it well. " * 40,
            "input_schema": {
                "type": "object",
                "properties": {"arg": {"type": "string", "description": "an argument"}},
                "required": ["arg"],
                "additionalProperties": False,
                "$schema": "http://json-schema.org/draft-07/schema#",
            },
        }
        for name in (
            "Task", "Bash", "Glob", "Grep", "ExitPlanMode", "Read",
            "Edit", "Write", "NotebookEdit", "WebFetch", "TodoWrite", "ToolSearch",
        )
    ]  # fmt: skip
    tools.append({**tools[0], "name": "mcp__docs__search", "defer_loading": True})
    user_id = json.dumps(
        {
            "device_id": "ab" * 32,
            "account_uuid": "",
            "session_id": "5f0c3a4e-4c1b-4c39-9d1e-0a4b5c6d7e8f",
        }
    )
    reminders = [
        {"type": "text", "text": f"<system-reminder>note {i}</system-reminder>"} for i in range(8)
    ]
    return {
        "model": MODEL,
        "max_tokens": 32000,
        "stream": True,
        # NOTE: 2.1.328 as captured: adaptive thinking, effort, and the environment as a
        # system turn after the user's, holding the last breakpoint.
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": user_id},
        "system": [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=sdk-cli",
            },
            {
                "type": "text",
                "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                "cache_control": {"type": "ephemeral"},
            },
            {
                "type": "text",
                "text": "You are an interactive CLI tool. " * 120,
                "cache_control": {"type": "ephemeral"},
            },
        ],
        "tools": tools,
        "messages": [
            {
                "role": "user",
                "content": [
                    *reminders,
                    {"type": "text", "text": "say hi"},
                ],
            },
            {
                "role": "system",
                "content": [
                    {
                        "type": "text",
                        "text": "# Environment\n - Primary working directory: /tmp/p",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
        ],
    }


def test_a_claude_code_request_streams_end_to_end(gateway_for):
    script = _script()
    gw: Gateway = gateway_for(script, max_context_tokens=200_000)
    headers = {"x-claude-code-session-id": "5f0c3a4e-4c1b-4c39-9d1e-0a4b5c6d7e8f"}
    body = claude_code_body()
    with httpx.stream(
        "POST",
        f"{gw.url}/v1/messages?beta=true",
        json=body,
        headers={
            "x-api-key": gw.keys["a"],
            "anthropic-version": "2023-06-01",
            "anthropic-beta": CLAUDE_CODE_BETAS,
            **headers,
        },
        timeout=60,
    ) as r:
        r.read()
    assert r.status_code == 200, r.text
    assert IGNORED not in r.headers
    events = sse_events(r)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["text"]  # no thinking blocks from a model without reasoning
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "Hello"
    (sent,) = script.bodies
    assert sent["max_tokens"] == 32000 and len(sent["breakpoints"]) == 3
    assert len(gw.wait_rows(1)) == 1


def test_output_config_and_system_turns(gateway_for):
    gw: Gateway = gateway_for(_script())
    for effort in ("low", "medium", "high", "xhigh", "max"):
        assert post(gw, ask(output_config={"effort": effort})).status_code == 200
    budget = {"effort": "high", "task_budget": {"type": "tokens", "total": 400000}}
    assert post(gw, ask(output_config=budget)).status_code == 200
    assert "effort" in error_of(post(gw, ask(output_config={"effort": "huge"})))
    fmt = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    assert "output_config.format: structured outputs are not available" in (
        error_of(post(gw, ask(output_config=fmt)))
    )
    turn = {"role": "system", "content": "env", "output_config": {"effort": "low"}}
    assert post(gw, ask(messages=[*MSGS, turn])).status_code == 200
    image = {"type": "image", "source": {"type": "url", "url": "http://x/a.png"}}
    bad_turn = {"role": "system", "content": [image]}
    assert "a system message holds only text blocks" in error_of(
        post(gw, ask(messages=[*MSGS, bad_turn]))
    )
    stray = {"role": "user", "content": "hi", "output_config": {"effort": "low"}}
    assert "only a system message carries one" in error_of(post(gw, ask(messages=[stray])))
    counted = post(
        gw,
        {"model": MODEL, "messages": [*MSGS, turn], "output_config": budget},
        path="/v1/messages/count_tokens",
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
