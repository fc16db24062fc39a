"""Property: through SmolLM2's chat template, turn n+1 of a random agent session starts
with exactly turn n's tokens up to turn n's last breakpoint, and that breakpoint is
one of turn n+1's block ends (so the 20-block lookback finds the entry turn n wrote)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachepoint.gateway.contract.template import build_renderer
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.replica.model_source import preset_path

from .plans import last_breakpoint

# NOTE: preset_path raises, naming the install step, when the model is missing: the
# Makefile installs it, and a skipped reference check would hide a missing install.
GGUF = preset_path("smollm2")

RENDERER = build_renderer(GGUF)

# Fragments chosen to sit on BPE's awkward spots: braces and quotes next to the
# template's own, whitespace runs, special-token text, multi-byte characters.
FRAGMENTS = ["hello", " world", " ", "  ", "\n", "\n\n", "\t", "}", "{", '"', "'s", ":", ",",
             "123", "<|im_end|>", "你好", "🙂", "é", "x"]  # fmt: skip
texts = st.lists(st.sampled_from(FRAGMENTS), min_size=0, max_size=8).map("".join)
nonempty = st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=8).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=6,
)


TOOLS = [
    {"name": "search", "description": "Search the web.", "input_schema": {"type": "object"}},
    {"name": "read_file", "input_schema": {"type": "object", "properties": {"p": {}}}},
]


@st.composite
def sessions(draw: Any) -> dict[str, Any]:
    """A system prompt, maybe tools, and alternating user/assistant turns."""
    with_tools = draw(st.booleans())
    turns: list[dict[str, Any]] = []
    pending: list[str] = []  # tool_use ids the next user turn answers
    for t in range(draw(st.integers(2, 5))):
        blocks: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": tid, "content": draw(texts)} for tid in pending
        ]
        blocks += [{"type": "text", "text": draw(nonempty)} for _ in range(draw(st.integers(0, 2)))]
        if not blocks:
            blocks = [{"type": "text", "text": draw(nonempty)}]
        turns.append({"role": "user", "content": blocks})
        reply: list[dict[str, Any]] = []
        if draw(st.booleans()):
            reply.append({"type": "text", "text": draw(nonempty)})
        pending = []
        if with_tools:
            for k in range(draw(st.integers(0, 2))):
                tid = f"toolu_{t}_{k}"
                pending.append(tid)
                args = draw(st.dictionaries(texts, json_values, max_size=3))
                reply.append({"type": "tool_use", "id": tid, "name": "search", "input": args})
        if not reply:
            reply = [{"type": "text", "text": draw(nonempty)}]
        turns.append({"role": "assistant", "content": reply})
    system = draw(nonempty)
    return {"system": system, "tools": TOOLS if with_tools else None, "turns": turns}


def _request(session: dict[str, Any], upto: int) -> MessagesRequest:
    """The request an agent sends for user turn ``upto``: the history, with the
    breakpoint on the system prompt and on the last block of the newest user turn."""
    msgs = [
        {**m, "content": [dict(b) for b in m["content"]]} for m in session["turns"][: 2 * upto + 1]
    ]
    msgs[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": 8,
        "system": [
            {"type": "text", "text": session["system"], "cache_control": {"type": "ephemeral"}}
        ],
        "messages": msgs,
    }
    if session["tools"]:
        body["tools"] = session["tools"]
    return MessagesRequest.model_validate(body)


def _last_breakpoint(req: MessagesRequest) -> tuple[Any, int]:
    return last_breakpoint(RENDERER, req)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sessions())
def test_turn_n_plus_1_extends_turn_n_up_to_its_last_breakpoint(session: dict[str, Any]) -> None:
    n_turns = len(session["turns"]) // 2
    prev, prev_bp = _last_breakpoint(_request(session, 0))
    for n in range(1, n_turns):
        cur, cur_bp = _last_breakpoint(_request(session, n))
        assert list(cur.tokens[:prev_bp]) == list(prev.tokens[:prev_bp])
        assert prev_bp in {s.end for s in cur.blocks}
        assert cur_bp > prev_bp
        prev, prev_bp = cur, cur_bp


@pytest.fixture(scope="module")
def ref_tok() -> Any:
    import transformers  # the reference: a dev dependency, never skipped

    return transformers.AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


@pytest.mark.slow
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(sessions())
def test_random_sessions_equal_transformers(ref_tok: Any, session: dict[str, Any]) -> None:
    """Cutting at block ends never changes the ids: the segmented encoding equals
    transformers' ``apply_chat_template`` (whole-string encoding) on random sessions
    whose blocks end in braces, quotes, whitespace runs and special-token text."""
    from cachepoint.gateway.contract.template import CHATML_TOOLS_TEMPLATE, to_conversation

    req = _request(session, len(session["turns"]) // 2 - 1)
    conv = to_conversation(req, marks=False)
    ref = ref_tok.apply_chat_template(
        [dict(m) for m in conv.messages],
        tools=conv.tools,
        chat_template=CHATML_TOOLS_TEMPLATE if session["tools"] else None,
        add_generation_prompt=True,
        tokenize=True,
    )
    ref_ids = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert list(RENDERER.render(req).tokens) == ref_ids
