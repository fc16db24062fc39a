"""context_management edits on exact requests (contract/context_edits.py), rendered
with the byte tokenizer: one token per UTF-8 byte, so token counts are byte counts."""

from __future__ import annotations

from typing import Any

import pytest

from cachepoint.gateway.contract import context_edits
from cachepoint.gateway.contract.context_edits import CLEARED_RESULT, apply
from cachepoint.gateway.contract.render import Renderer
from cachepoint.gateway.errors import ApiError
from cachepoint.gateway.schemas.messages import CountTokensRequest, MessagesRequest
from cachepoint.tokenizer import ByteTokenizer

R = Renderer(ByteTokenizer())
TOOLS = [
    {"name": "read", "input_schema": {"type": "object"}},
    {"name": "grep", "input_schema": {"type": "object"}},
]
BODY = 300  # bytes of each tool result
PLACEHOLDER = len(CLEARED_RESULT.encode())


def history(names: list[str]) -> list[dict[str, Any]]:
    """A user question, then one tool call per name, each answered by a BODY-byte result."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Look around."}]
    for i, name in enumerate(names):
        tid = f"toolu_{i}"
        msgs.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"call {i}"},
                    {"type": "tool_use", "id": tid, "name": name, "input": {"path": f"f{i}"}},
                ],
            }
        )
        msgs.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tid, "content": str(i % 10) * BODY}
                ],
            }
        )
    return msgs


def request(edits: list[dict[str, Any]] | None, names: list[str], **kw: Any) -> MessagesRequest:
    body: dict[str, Any] = {"model": "m", "max_tokens": 8, "tools": TOOLS}
    body["messages"] = history(names)
    if edits is not None:
        body["context_management"] = {"edits": edits}
    return MessagesRequest.model_validate(body | kw)


def result_of(req: MessagesRequest, i: int) -> Any:
    return req.messages[2 + 2 * i].content[0].content


def input_of(req: MessagesRequest, i: int) -> Any:
    return req.messages[1 + 2 * i].content[1].input


def clear(**kw: Any) -> dict[str, Any]:
    return {"type": "clear_tool_uses_20250919", **kw}


LOW = {"type": "input_tokens", "value": 100}  # any of these histories exceeds it


def test_no_context_management_changes_nothing_and_reports_nothing():
    req = request(None, ["read"] * 5)
    out = apply(req, R._render)
    assert out.request is req and out.applied is None
    assert R.render(req).applied_edits is None
    assert context_edits.report(None) is None
    empty = request([], ["read"] * 5)
    assert apply(empty, R._render).applied == ()
    assert context_edits.report(()) == {"applied_edits": []}


def test_clear_tool_uses_keeps_the_most_recent_and_clears_the_oldest_results():
    req = request([clear(trigger=LOW, keep={"type": "tool_uses", "value": 2})], ["read"] * 5)
    out = apply(req, R._render)
    assert [result_of(out.request, i) for i in range(5)] == [CLEARED_RESULT] * 3 + [
        "3" * BODY,
        "4" * BODY,
    ]
    # Inputs stay by default: only results are cleared.
    assert [input_of(out.request, i) for i in range(5)] == [{"path": f"f{i}"} for i in range(5)]
    (edit,) = out.applied
    assert edit.as_dict() == {
        "type": "clear_tool_uses_20250919",
        "cleared_tool_uses": 3,
        "cleared_input_tokens": 3 * (BODY - PLACEHOLDER),
    }
    # The exact difference of the two prompts, and the render reflects it.
    rendered = R.render(req)
    assert len(R._render(req)) - len(rendered) == 3 * (BODY - PLACEHOLDER)
    assert rendered.applied_edits == out.applied


def test_clear_tool_uses_defaults_trigger_at_100k_input_tokens_and_keep_3():
    small = request([clear()], ["read"] * 6)
    assert apply(small, R._render).applied == ()  # ~2k tokens: far below 100,000
    big = request([clear(trigger=LOW)], ["read"] * 6)
    out = apply(big, R._render)
    assert out.applied[0].cleared_tool_uses == 3
    assert [result_of(out.request, i) == CLEARED_RESULT for i in range(6)] == [True] * 3 + [
        False
    ] * 3


def test_trigger_is_exceeding_the_threshold_not_reaching_it():
    req = request([clear(keep={"type": "tool_uses", "value": 0})], ["read"] * 2)
    n = len(R._render(req))
    at = request(
        [
            clear(
                trigger={"type": "input_tokens", "value": n}, keep={"type": "tool_uses", "value": 0}
            )
        ],
        ["read"] * 2,
    )
    over = request(
        [
            clear(
                trigger={"type": "input_tokens", "value": n - 1},
                keep={"type": "tool_uses", "value": 0},
            )
        ],
        ["read"] * 2,
    )
    assert apply(at, R._render).applied == ()
    assert apply(over, R._render).applied[0].cleared_tool_uses == 2


def test_trigger_on_tool_uses_counts_calls_in_the_history():
    four = {"type": "tool_uses", "value": 4}
    keep1 = {"type": "tool_uses", "value": 1}
    assert apply(request([clear(trigger=four, keep=keep1)], ["read"] * 4), R._render).applied == ()
    out = apply(request([clear(trigger=four, keep=keep1)], ["read"] * 5), R._render)
    assert out.applied[0].cleared_tool_uses == 4


def test_exclude_tools_are_never_cleared_but_count_among_the_kept():
    names = ["grep", "read", "grep", "read", "read"]
    req = request(
        [clear(trigger=LOW, keep={"type": "tool_uses", "value": 1}, exclude_tools=["grep"])], names
    )
    out = apply(req, R._render)
    cleared = [result_of(out.request, i) == CLEARED_RESULT for i in range(5)]
    assert cleared == [False, True, False, True, False]
    assert out.applied[0].cleared_tool_uses == 2


@pytest.mark.parametrize(
    ("option", "cleared_inputs"),
    [(True, [True, True, False]), (["grep"], [False, True, False]), (False, [False] * 3)],
)
def test_clear_tool_inputs_true_or_a_list_of_tools(option, cleared_inputs):
    req = request(
        [clear(trigger=LOW, keep={"type": "tool_uses", "value": 1}, clear_tool_inputs=option)],
        ["read", "grep", "read"],
    )
    out = apply(req, R._render)
    assert [input_of(out.request, i) == {} for i in range(3)] == cleared_inputs
    saved = (
        2 * (BODY - PLACEHOLDER)
        + sum(cleared_inputs) * len('{"path":"f0"}')
        - sum(cleared_inputs) * len("{}")
    )
    assert out.applied[0].cleared_input_tokens == saved


def test_clear_at_least_not_reached_leaves_the_history_alone():
    enough = {"type": "input_tokens", "value": 2 * (BODY - PLACEHOLDER)}
    too_much = {"type": "input_tokens", "value": 2 * (BODY - PLACEHOLDER) + 1}
    keep = {"type": "tool_uses", "value": 1}
    names = ["read"] * 3
    ok = apply(request([clear(trigger=LOW, keep=keep, clear_at_least=enough)], names), R._render)
    assert ok.applied[0].cleared_input_tokens == 2 * (BODY - PLACEHOLDER)
    req = request([clear(trigger=LOW, keep=keep, clear_at_least=too_much)], names)
    out = apply(req, R._render)
    assert out.applied == () and out.request is req
    assert R.render(req).tokens == R._render(req).tokens


def test_block_paths_and_breakpoints_stay_where_they_were():
    """Clearing rewrites blocks in place: every span keeps its path, and a breakpoint
    on a cleared result still names the same block."""
    msgs = history(["read"] * 3)
    msgs[2]["content"][0]["cache_control"] = {"type": "ephemeral"}
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "tools": TOOLS,
            "messages": msgs,
            "context_management": {"edits": [clear(trigger=LOW)]},
        }
    )
    before, after = R._render(req), R.render(req)
    assert [s.path for s in before.blocks] == [s.path for s in after.blocks]
    marked = [s for s in after.blocks if s.cache_control is not None]
    assert [s.path for s in marked] == ["messages.2.content.0"]


def thinking_history(turns: int) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"q{t}"})
        msgs.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": f"reasoning {t}", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": f"a{t}"},
                ],
            }
        )
    msgs.append({"role": "user", "content": "next"})
    return msgs


def thinking_request(keep: Any) -> MessagesRequest:
    edit: dict[str, Any] = {"type": "clear_thinking_20251015"}
    if keep is not None:
        edit["keep"] = keep
    return MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "messages": thinking_history(4),
            "context_management": {"edits": [edit]},
        }
    )


@pytest.mark.parametrize(
    ("keep", "cleared"),
    [
        (None, 3),  # Anthropic's default: the last turn's thinking
        ({"type": "thinking_turns", "value": 2}, 2),
        ({"type": "thinking_turns", "value": 9}, None),
        ("all", None),  # what Claude Code sends
        ({"type": "all"}, None),
    ],
)
def test_clear_thinking_keeps_the_last_turns_and_changes_no_token(keep, cleared):
    req = thinking_request(keep)
    out = apply(req, R._render)
    if cleared is None:
        assert out.applied == ()
        return
    assert [e.as_dict() for e in out.applied] == [
        {
            "type": "clear_thinking_20251015",
            "cleared_thinking_turns": cleared,
            # Thinking never reaches the prompt here (no reasoning mode), so no token.
            "cleared_input_tokens": 0,
        }
    ]
    thoughts = [m.content[0].thinking for m in out.request.messages if m.role == "assistant"]
    assert thoughts == [""] * cleared + [f"reasoning {t}" for t in range(cleared, 4)]
    assert R.render(req).tokens == R._render(req).tokens


def test_both_edits_report_in_order():
    msgs = history(["read"] * 4)
    msgs[1]["content"].insert(0, {"type": "thinking", "thinking": "t", "signature": "s"})
    msgs[3]["content"].insert(0, {"type": "thinking", "thinking": "u", "signature": "s"})
    req = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "tools": TOOLS,
            "messages": msgs,
            "context_management": {
                "edits": [
                    {"type": "clear_thinking_20251015"},
                    clear(trigger=LOW, keep={"type": "tool_uses", "value": 2}),
                ]
            },
        }
    )
    assert context_edits.report(R.render(req).applied_edits) == {
        "applied_edits": [
            {
                "type": "clear_thinking_20251015",
                "cleared_thinking_turns": 1,
                "cleared_input_tokens": 0,
            },
            {
                "type": "clear_tool_uses_20250919",
                "cleared_tool_uses": 2,
                "cleared_input_tokens": 2 * (BODY - PLACEHOLDER),
            },
        ]
    }


def test_clear_thinking_listed_after_clear_tool_uses_is_a_400():
    req = request([clear(), {"type": "clear_thinking_20251015", "keep": "all"}], ["read"])
    with pytest.raises(ApiError) as err:
        R.render(req)
    assert err.value.status == 400
    assert err.value.message == (
        "context_management.edits.1: clear_thinking_20251015 must be listed first in "
        "context_management.edits"
    )


def test_count_tokens_counts_the_edited_prompt():
    """Anthropic's count_tokens previews the prompt after context editing."""
    body = {
        "model": "m",
        "tools": TOOLS,
        "messages": history(["read"] * 4),
        "context_management": {"edits": [clear(trigger=LOW)]},
    }
    counted = R.render(CountTokensRequest.model_validate(body))
    plain = R.render(CountTokensRequest.model_validate(body | {"context_management": None}))
    assert len(plain) - len(counted) == 1 * (BODY - PLACEHOLDER)


def test_an_empty_result_is_not_cleared_nor_counted():
    req = request([clear(trigger=LOW, keep={"type": "tool_uses", "value": 1})], ["read"] * 3)
    msgs = [m.model_dump(exclude_none=True) for m in req.messages]
    msgs[2]["content"][0]["content"] = ""  # use 0 answered with nothing
    req = req.model_copy(
        update={
            "messages": MessagesRequest.model_validate(
                {"model": "m", "max_tokens": 8, "messages": msgs}
            ).messages
        }
    )
    out = apply(req, R._render)
    assert [result_of(out.request, i) for i in range(3)] == ["", CLEARED_RESULT, "2" * BODY]
    assert [e.as_dict() for e in out.applied] == [
        {
            "type": "clear_tool_uses_20250919",
            "cleared_tool_uses": 1,
            "cleared_input_tokens": BODY - PLACEHOLDER,
        }
    ]
