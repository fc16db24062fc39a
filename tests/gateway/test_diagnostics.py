"""Cache diagnostics through the official SDK against a live gateway and a real replica:
Anthropic's `diagnostics` contract, parsed into the SDK's own types.

Expected token counts are computed here from the documented byte-tokenizer rendering
(tests/gateway/test_conformance.py), not by asking the gateway: one token a UTF-8 byte,
one separator after each block, a role header before each message.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest
from anthropic.types import (
    CacheMissMessagesChanged,
    CacheMissPreviousMessageNotFound,
    CacheMissSystemChanged,
    CacheMissToolsChanged,
    CacheMissUnavailable,
)
from anthropic.types.beta import BetaCacheMissSystemChanged
from sqlalchemy import select

from cachepoint.gateway.db.models import UsageRecord
from cachepoint.gateway.db.session import make_engine

MODEL = "cachepoint-tiny"
SYSTEM = "You are the support agent for a company that sells kettles. " * 4
BOS, HEADER, SEP = 1, 1, 1
BLOCK = 16  # the stack's block size: caches, and so shared prefixes, count whole blocks
OPT_IN = {"previous_message_id": None}


def client(stack, who: str = "a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack["url"], api_key=stack["keys"][who], max_retries=0)


def n(text: str) -> int:
    return len(text.encode())


def cached(text: str) -> dict:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}


def ask(c, messages, *, system=SYSTEM, diagnostics=OPT_IN, **kw):
    return c.messages.create(
        model=MODEL,
        max_tokens=4,
        system=system,
        messages=messages,
        diagnostics=diagnostics,
        extra_body={"temperature": 0.0},
        **kw,
    )


def floor(tokens: int) -> int:
    return tokens // BLOCK * BLOCK


U1, A1, U2 = "Where is my order #1234?", "It ships tomorrow.", "Can I change the address?"
# The first turn's prompt to the end of its marked block: where its breakpoint sits.
P1 = BOS + HEADER + n(SYSTEM) + SEP + HEADER + n(U1) + SEP


def turn2(u1: str = U1) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": u1}]},
        {"role": "assistant", "content": A1},
        {"role": "user", "content": [cached(U2)]},
    ]


def test_a_first_turn_opts_in_and_an_appending_turn_has_nothing_to_report(stack):
    c = client(stack)
    r1 = ask(c, [{"role": "user", "content": [cached(U1)]}])
    assert r1.diagnostics is None  # first turn: nothing to compare
    r2 = ask(c, turn2(), diagnostics={"previous_message_id": r1.id})
    assert r2.diagnostics is None  # only appended: no divergence
    assert r2.usage.cache_read_input_tokens == P1


def test_without_diagnostics_there_is_no_field_and_nothing_is_kept(stack):
    c = client(stack)
    raw = httpx.post(
        f"{stack['url']}/v1/messages",
        headers={"x-api-key": stack["keys"]["a"], "anthropic-version": "2023-06-01"},
        json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": U1}]},
        timeout=60,
    )
    assert raw.status_code == 200 and "diagnostics" not in raw.json()
    later = ask(c, turn2(), diagnostics={"previous_message_id": raw.json()["id"]})
    assert isinstance(later.diagnostics.cache_miss_reason, CacheMissPreviousMessageNotFound)


def test_a_changed_system_names_the_system_and_the_tokens_it_cost(stack):
    c = client(stack)
    r1 = ask(c, [{"role": "user", "content": [cached(U1)]}])
    k = 100  # the byte the system text first differs at
    system = SYSTEM[:k] + "X" + SYSTEM[k + 1 :]
    r2 = ask(c, turn2(), system=system, diagnostics={"previous_message_id": r1.id})
    reason = r2.diagnostics.cache_miss_reason
    assert isinstance(reason, CacheMissSystemChanged)
    first = BOS + HEADER + k  # the first token that differs
    assert reason.cache_missed_input_tokens == P1 - floor(first)
    extension = r2.diagnostics.model_extra["cachepoint"]
    assert extension == {
        "reason": "system_changed",
        "first_divergent_token": floor(first),
        "previous_cached_tokens": P1,
    }
    # And usage agrees: what was read is what the two prompts share in whole blocks.
    assert r2.usage.cache_read_input_tokens <= floor(first)


def test_an_edited_earlier_message_is_messages_changed(stack):
    c = client(stack)
    r1 = ask(c, [{"role": "user", "content": [cached(U1)]}])
    k = 9
    edited = U1[:k] + "#" + U1[k + 1 :]
    r2 = ask(c, turn2(edited), diagnostics={"previous_message_id": r1.id})
    reason = r2.diagnostics.cache_miss_reason
    assert isinstance(reason, CacheMissMessagesChanged)
    first = BOS + HEADER + n(SYSTEM) + SEP + HEADER + k
    assert reason.cache_missed_input_tokens == P1 - floor(first)


def test_changed_tools_are_tools_changed_even_when_the_system_changed_too(stack):
    """Tools come first in the prompt: the earliest divergence is reported."""
    c = client(stack)
    tool = {"name": "lookup", "description": "Find an order.", "input_schema": {"type": "object"}}
    r1 = ask(c, [{"role": "user", "content": [cached(U1)]}], tools=[tool])
    moved = dict(tool, description="Find an order by its number.")
    r2 = ask(
        c,
        turn2(),
        system=SYSTEM + "Be brief.",
        tools=[moved],
        diagnostics={"previous_message_id": r1.id},
    )
    reason = r2.diagnostics.cache_miss_reason
    assert isinstance(reason, CacheMissToolsChanged)
    assert 0 < reason.cache_missed_input_tokens <= r1.usage.cache_creation_input_tokens + 1


def test_another_prompt_parameter_only_is_unavailable(stack):
    c = client(stack)
    r1 = ask(c, [{"role": "user", "content": [cached(U1)]}])
    r2 = ask(c, turn2(), thinking={"type": "disabled"}, diagnostics={"previous_message_id": r1.id})
    assert isinstance(r2.diagnostics.cache_miss_reason, CacheMissUnavailable)
    assert r2.usage.cache_read_input_tokens == P1  # the cache still hit: no prompt change


def test_unknown_ids_and_another_orgs_ids_are_not_found_alike(stack):
    a, b = client(stack, "a"), client(stack, "b")
    theirs = ask(b, [{"role": "user", "content": [cached(U1)]}])
    for previous in (theirs.id, "msg_0123456789abcdef"):
        r = ask(
            a,
            [{"role": "user", "content": [cached(U1)]}],
            diagnostics={"previous_message_id": previous},
        )
        assert isinstance(r.diagnostics.cache_miss_reason, CacheMissPreviousMessageNotFound)


def test_an_id_that_cannot_be_a_message_id_is_a_clear_400(stack):
    c = client(stack)
    with pytest.raises(anthropic.BadRequestError) as exc:
        ask(c, [{"role": "user", "content": U1}], diagnostics={"previous_message_id": "req_123"})
    assert "must be the `id` from a prior /v1/messages response (starts with `msg_`)" in str(
        exc.value
    )


def test_streaming_carries_diagnostics_on_message_start(stack):
    c = client(stack)
    r1 = ask(c, [{"role": "user", "content": [cached(U1)]}])
    with c.messages.stream(
        model=MODEL,
        max_tokens=4,
        system=SYSTEM + "!",
        messages=turn2(),
        diagnostics={"previous_message_id": r1.id},
    ) as stream:
        first = next(iter(stream))
        assert first.type == "message_start"
        assert isinstance(first.message.diagnostics.cache_miss_reason, CacheMissSystemChanged)
        final = stream.get_final_message()
    assert isinstance(final.diagnostics.cache_miss_reason, CacheMissSystemChanged)


def test_the_beta_surface_parses_into_the_beta_types(stack):
    c = client(stack)
    r1 = ask(c, [{"role": "user", "content": [cached(U1)]}])
    r2 = c.beta.messages.create(
        model=MODEL,
        max_tokens=4,
        system="Another system entirely.",
        messages=turn2(),
        diagnostics={"previous_message_id": r1.id},
        betas=["cache-diagnosis-2026-04-07"],
    )
    assert isinstance(r2.diagnostics.cache_miss_reason, BetaCacheMissSystemChanged)
    # This turn is shorter than the first one's cached prefix: it could have read no
    # further than its own breakpoint (the end of its last message).
    system = "Another system entirely."
    end = BOS + HEADER + n(system) + SEP + HEADER + n(U1) + SEP + HEADER + n(A1) + SEP
    end += HEADER + n(U2) + SEP
    assert end < P1
    assert r2.diagnostics.cache_miss_reason.cache_missed_input_tokens == end - floor(BOS + HEADER)


def test_count_tokens_takes_a_diagnostics_field_and_ignores_it(stack):
    raw = httpx.post(
        f"{stack['url']}/v1/messages/count_tokens",
        headers={"x-api-key": stack["keys"]["a"], "anthropic-version": "2023-06-01"},
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": U1}],
            "diagnostics": {"previous_message_id": "msg_x"},
        },
        timeout=60,
    )
    assert raw.status_code == 200 and set(raw.json()) == {"input_tokens"}


def _ledger(stack, request_id: str) -> tuple[str | None, int | None]:
    engine = make_engine(stack["db"])
    try:
        with engine.connect() as conn:
            row = conn.execute(
                select(UsageRecord.miss_reason, UsageRecord.miss_tokens).where(
                    UsageRecord.request_id == request_id
                )
            ).one()
    finally:
        engine.dispose()
    return row[0], row[1]


def test_a_session_is_diagnosed_without_opting_in_into_the_ledger_only(stack):
    """Claude Code's session header: each turn is compared with the turn of the session
    it continues (a side request in the same session, with another prompt, is not it)."""
    c = client(stack)
    session = {"X-Claude-Code-Session-Id": "0b6d7c1e-5a7e-4a51-9f39-2f6a4f3c9d10"}

    def turn(messages, system=SYSTEM):
        r = c.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=4,
            system=system,
            messages=messages,
            extra_headers=session,
            extra_body={"temperature": 0.0},
        )
        assert "diagnostics" not in r.http_response.json()  # nothing asked for: no field
        return r.parse()

    t1 = turn([{"role": "user", "content": [cached(U1)]}])
    side = turn([{"role": "user", "content": "Summarize in five words."}], system="Titles.")
    t2 = turn(turn2())
    t3 = turn([*turn2(), {"role": "assistant", "content": "Yes."}], system=SYSTEM + "Now.")
    assert _ledger(stack, t1._request_id) == (None, None)  # the session's first turn
    assert _ledger(stack, side._request_id)[0] == "system_changed"
    assert _ledger(stack, t2._request_id) == ("none", None)  # continues t1, only appended
    reason, tokens = _ledger(stack, t3._request_id)
    assert reason == "system_changed"
    p2 = P1 + HEADER + n(A1) + SEP + HEADER + n(U2) + SEP  # t2's breakpoint
    assert tokens == p2 - floor(BOS + HEADER + n(SYSTEM))


def test_the_ledger_keeps_an_opted_in_turns_reason_too(stack):
    c = client(stack)
    r1 = ask(c, [{"role": "user", "content": [cached(U1)]}])
    r2 = ask(c, turn2(), system="Changed.", diagnostics={"previous_message_id": r1.id})
    reason = r2.diagnostics.cache_miss_reason
    assert _ledger(stack, r2._request_id) == ("system_changed", reason.cache_missed_input_tokens)
    r3 = ask(c, turn2(), diagnostics={"previous_message_id": "msg_unknown"})
    assert _ledger(stack, r3._request_id) == ("previous_message_not_found", None)


def test_a_turn_after_one_too_short_to_cache_is_below_minimum_in_the_ledger(stack):
    c = client(stack)
    session = {"X-Claude-Code-Session-Id": "5d1c2f0a-7b0e-4c55-8a0b-0c1d2e3f4a5b"}
    kw = dict(model=MODEL, max_tokens=2, extra_headers=session, extra_body={"temperature": 0.0})
    short = [{"role": "user", "content": [cached("Hi.")]}]  # under the 64-token minimum
    r1 = c.messages.create(messages=short, **kw)
    assert r1.usage.cache_creation_input_tokens == 0
    longer = [*short, {"role": "assistant", "content": "Hello."}]
    longer.append({"role": "user", "content": [cached("Tell me about kettles. " * 4)]})
    r2 = c.messages.create(messages=longer, **kw)
    assert _ledger(stack, r2._request_id) == ("below_minimum", 0)


def test_a_sessions_first_turn_is_compared_with_the_keys_last_session_it_shares_with(stack):
    """A new Claude Code session in the same project starts with the same tools and a
    system text that names another working directory: the break is the system's."""
    c = client(stack)

    def first_turn(session: str, system: str):
        return c.messages.create(
            model=MODEL,
            max_tokens=2,
            system=system,
            messages=[{"role": "user", "content": [cached(U1)]}],
            extra_headers={"X-Claude-Code-Session-Id": session},
            extra_body={"temperature": 0.0},
        )

    first_turn("aaaaaaaa-0000-4000-8000-000000000001", SYSTEM + "cwd: /home/dev/app")
    k = len(SYSTEM) + len("cwd: /home/dev/")
    again = first_turn("aaaaaaaa-0000-4000-8000-000000000002", SYSTEM + "cwd: /home/dev/lib")
    p_prev = BOS + HEADER + n(SYSTEM + "cwd: /home/dev/app") + SEP + HEADER + n(U1) + SEP
    assert _ledger(stack, again._request_id) == (
        "system_changed",
        p_prev - floor(BOS + HEADER + k),
    )
    # A session that shares not one block with anything before is not compared.
    other = first_turn("aaaaaaaa-0000-4000-8000-000000000003", "Unrelated. " * 30)
    assert _ledger(stack, other._request_id) == (None, None)
