"""Fingerprints without a server: what diagnose() answers, and what a fingerprint weighs."""

from __future__ import annotations

from array import array

import pytest

from cachepoint.gateway.contract.fingerprint import (
    Fingerprint,
    FingerprintError,
    betas_hash,
    diagnose,
    fingerprint,
)
from cachepoint.gateway.contract.prompt import BlockSpan, RenderedPrompt
from cachepoint.gateway.diagnostics import answer, diagnosed

BS = 16


def render(tools: list[int], system: list[int], messages: list[list[int]]) -> RenderedPrompt:
    """A prompt laid out as the renderers lay it out: tools, system, then each message."""
    tokens, spans = array("i"), []

    def add(path: str, section: str, piece: list[int]) -> None:
        start = len(tokens)
        tokens.extend(piece)
        spans.append(BlockSpan(path, section, "text", start, len(tokens), True, None))  # type: ignore[arg-type]

    if tools:
        add("tools.0", "tools", tools)
    if system:
        add("system.0", "system", system)
    for i, m in enumerate(messages):
        add(f"messages.{i}.content.0", "messages", m)
    return RenderedPrompt(tokens, tuple(spans))


def fp(
    prompt: RenderedPrompt,
    *,
    model: str = "m",
    params: int = 0,
    cached_end: int | None = None,
    **kw,
):
    end = len(prompt) if cached_end is None else cached_end
    return fingerprint(prompt, model=model, params=params, cached_end=end, block_size=BS, **kw)


TOOLS = list(range(1000, 1040))
SYSTEM = list(range(2000, 2100))
M0, M1, M2 = list(range(3000, 3050)), list(range(4000, 4020)), list(range(5000, 5030))


def test_appending_messages_is_no_divergence():
    prev = fp(render(TOOLS, SYSTEM, [M0]))
    assert diagnose(prev, fp(render(TOOLS, SYSTEM, [M0, M1, M2]))) is None


@pytest.mark.parametrize(
    ("cur", "reason", "first"),
    [
        (render([*TOOLS[:-1], 7], SYSTEM, [M0, M1]), "tools_changed", 39),
        (render(TOOLS, [*SYSTEM[:50], 7, *SYSTEM[51:]], [M0, M1]), "system_changed", 90),
        (render(TOOLS, SYSTEM, [[7, *M0[1:]], M1]), "messages_changed", 140),
        (render(TOOLS, SYSTEM, []), "messages_changed", 140),  # removed, not appended
    ],
)
def test_the_first_divergence_and_the_exact_tokens_it_cost(cur, reason, first):
    prev_prompt = render(TOOLS, SYSTEM, [M0])
    prev = fp(prev_prompt)
    d = diagnose(prev, fp(cur))
    assert d is not None and d.reason == reason
    # Independently: the first differing token of the two token lists, in whole blocks.
    a, b = list(prev_prompt.tokens), list(cur.tokens)
    differ = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    assert differ == first
    assert d.shared_tokens == differ // BS * BS
    # What prev cached, up to what cur could read (its own length here), past the shared.
    assert d.missed_tokens == min(len(prev_prompt), len(cur)) - differ // BS * BS
    assert d.as_reason() == {"type": reason, "cache_missed_input_tokens": d.missed_tokens}


def test_the_tools_win_over_the_system_when_both_changed():
    prev = fp(render(TOOLS, SYSTEM, [M0]))
    d = diagnose(prev, fp(render([*TOOLS, 1], [*SYSTEM, 1], [M0])))
    assert d is not None and d.reason == "tools_changed"


def test_another_model_shares_nothing():
    prompt = render(TOOLS, SYSTEM, [M0])
    d = diagnose(fp(prompt, cached_end=160), fp(prompt, model="other"))
    assert d is not None and (d.reason, d.missed_tokens, d.shared_tokens) == (
        "model_changed",
        160,
        0,
    )


def test_other_parameters_alone_are_unavailable_without_tokens():
    prompt = render(TOOLS, SYSTEM, [M0])
    d = diagnose(fp(prompt), fp(prompt, params=1))
    assert d is not None and d.as_reason() == {"type": "unavailable"}


def test_a_change_past_the_cached_prefix_costs_nothing():
    prev = fp(render(TOOLS, SYSTEM, [M0]), cached_end=140)  # cached to the end of the system
    d = diagnose(prev, fp(render(TOOLS, SYSTEM, [[*M0[:-1], 7]])))
    assert d is not None and (d.reason, d.missed_tokens) == ("messages_changed", 0)


def test_the_answer_carries_anthropics_reason_and_the_extension():
    prev = fp(render(TOOLS, SYSTEM, [M0]))
    out = answer(prev, fp(render(TOOLS, [9, *SYSTEM[1:]], [M0])))
    assert out == {
        "cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 190 - 32},
        "cachepoint": {
            "reason": "system_changed",
            "first_divergent_token": 32,
            "previous_cached_tokens": 190,
        },
    }
    assert answer(None, prev) == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert answer(prev, prev) is None


def test_round_trip_size_and_refusals():
    big = render(TOOLS, SYSTEM, [list(range(10_000, 10_000 + 1600))] * 100)
    f = fp(big)
    data = f.encode()
    assert Fingerprint.decode(data) == f
    # About 4 bytes a 16-token block and 8 a message, plus a fixed head.
    assert len(data) <= 4 * (len(big) // BS) + 8 * 100 + 64
    with pytest.raises(FingerprintError, match="not a fingerprint"):
        Fingerprint.decode(b"\x00garbage")


def test_what_only_the_server_knows_goes_to_the_ledger_not_to_anthropics_answer():
    prompt = render(TOOLS, SYSTEM, [M0])
    prev = fp(prompt, cached_end=160)
    # The same prompt under another cache scope: Anthropic's answer is null (no prompt
    # change); the server knows the key changed, so every cached token was missed.
    d = diagnose(prev, fp(prompt, scope="global"))
    assert d is not None and (d.reason, d.server_reason, d.missed_tokens) == (
        None,
        "scope_changed",
        160,
    )
    assert answer(prev, fp(prompt, scope="global")) is None
    ledger = diagnosed(prev, fp(prompt, scope="global"), found=True)
    assert (ledger.answer, ledger.reason, ledger.missed_tokens) == (None, "scope_changed", 160)
    # A cache-key beta: Anthropic says unavailable (another parameter); the server says why.
    d = diagnose(prev, fp(prompt, params=1, key_betas=betas_hash({"context-1m-2025-08-07"})))
    assert d is not None and (d.reason, d.server_reason) == ("unavailable", "betas_changed")
    # A parameter outside the key: unavailable on both sides.
    d = diagnose(prev, fp(prompt, params=1))
    assert d is not None and (d.reason, d.server_reason) == ("unavailable", "unavailable")
    # The turn before was too short to cache: nothing to read, and that is why.
    short = fp(prompt, cached_end=0, below_minimum=True)
    d = diagnose(short, fp(render(TOOLS, SYSTEM, [M0, M1])))
    assert d is not None and (d.reason, d.server_reason, d.missed_tokens) == (
        None,
        "below_minimum",
        0,
    )
