"""The demo session must fit the tiny model's context at its full length."""

from __future__ import annotations

from cachepoint.embedded.demo_session import (
    MAX_TOKENS,
    MODEL,
    TOOLS,
    assistant_turn,
    next_request,
    system_blocks,
)
from cachepoint.gateway.contract.render import Renderer
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.tokenizer import ByteTokenizer

# A byte-tokenizer gateway's default max_context_tokens (the tiny model itself now
# takes 262,144 positions): the demo fits even the tightest setting, in bytes.
CONTEXT = 8192


def test_demo_session_twelve_turns_fit_the_context():
    renderer = Renderer(ByteTokenizer())
    messages: list[dict] = []
    tool_id = None
    worst_reply = "\ufffd" * MAX_TOKENS  # random output re-encodes to 3 bytes a token
    for turn in range(1, 13):
        next_request(messages, turn, tool_id)
        req = MessagesRequest.model_validate(
            {
                "model": MODEL,
                "max_tokens": MAX_TOKENS,
                "tools": TOOLS,
                "system": system_blocks(),
                "messages": messages,
            }
        )
        n = len(renderer.render(req))
        assert n + MAX_TOKENS <= CONTEXT, f"turn {turn}: {n} prompt tokens"
        reply, tool_id = assistant_turn(turn, worst_reply)
        messages.append(reply)
    assert sum(1 for m in messages if m["role"] == "user") == 12
