"""The tool-call parser on exact strings: whole texts and texts cut into token pieces."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachepoint.gateway.contract.toolcalls import (
    CLOSE,
    NO_FORCING,
    TextPart,
    ToolCall,
    ToolCallParser,
    forcing,
    offered,
    split,
)
from cachepoint.gateway.schemas.messages import MessagesRequest

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
ID = re.compile(r"^toolu_[A-Za-z0-9]{24}$")


def shape(parts: list[TextPart | ToolCall]) -> list[tuple[str, object]]:
    """Parts without their random ids."""
    return [
        ("text", p.text) if isinstance(p, TextPart) else ("tool_use", (p.name, p.input))
        for p in parts
    ]


def fed(pieces: list[str], names: frozenset[str] = NAMES) -> list[TextPart | ToolCall]:
    parser = ToolCallParser(names)
    parts = [p for piece in pieces for p in parser.feed(piece)]
    return parts + parser.finish()


def merged(parts: list[TextPart | ToolCall]) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for kind, value in shape(parts):
        if kind == "text" and out and out[-1][0] == "text":
            out[-1] = ("text", str(out[-1][1]) + str(value))
        else:
            out.append((kind, value))
    return out


def test_text_then_a_call():
    parts = split("Let me check.\n" + WEATHER, NAMES)
    assert shape(parts) == [
        ("text", "Let me check.\n"),
        ("tool_use", ("get_weather", {"city": "Paris"})),
    ]
    assert ID.match(parts[1].id)


def test_two_calls_and_the_newlines_between_them_make_no_text_block():
    parts = split(WEATHER + "\n" + TIME + "\n", NAMES)
    assert shape(parts) == [
        ("tool_use", ("get_weather", {"city": "Paris"})),
        ("tool_use", ("get_time", {"tz": "UTC"})),
    ]
    assert parts[0].id != parts[1].id
    assert all(ID.match(p.id) for p in parts)


def test_text_after_a_call_is_its_own_block():
    parts = split("A" + WEATHER + " then B", NAMES)
    assert shape(parts) == [
        ("text", "A"),
        ("tool_use", ("get_weather", {"city": "Paris"})),
        ("text", " then B"),
    ]


def test_arguments_as_a_json_string_and_missing_arguments():
    call = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}</tool_call>'
    assert shape(split(call, NAMES)) == [("tool_use", ("get_time", {"tz": "CET"}))]
    bare = '<tool_call>{"name": "get_time"}</tool_call>'
    assert shape(split(bare, NAMES)) == [("tool_use", ("get_time", {}))]


def test_unacceptable_calls_stay_text_exactly():
    bad = [
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not declared
        '<tool_call>{"name": "get_time", "arguments": {"tz": }</tool_call>',  # bad JSON
        '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>',  # not an object
        '<tool_call>{"name": "get_time", "arguments": "utc"}</tool_call>',  # string, not JSON
        '<tool_call>{"name": "get_time", "arguments": "[1]"}</tool_call>',  # string, not object
        '<tool_call>["get_time", {}]</tool_call>',  # not an object
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',  # name not a string
        '<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>',  # not JSON
        '<tool_call>{"name": "get_time", "arguments": {"x": "\\ud800"}}</tool_call>',  # surrogate
        '<tool_call>{"name": "get_time", "arguments": {}}',  # unclosed
        "Use <tool_call> like this",  # unclosed, text before
        "ends with <tool_c",  # a partial tag at the very end
    ]
    for text in bad:
        assert shape(split("x " + text, NAMES)) == [("text", "x " + text)], text
        assert shape(split(text, NAMES)) == [("text", text)], text


def test_a_bad_call_between_good_ones_is_text_between_them():
    text = WEATHER + '<tool_call>{"name": "nope"}</tool_call>' + TIME
    assert shape(split(text, NAMES)) == [
        ("tool_use", ("get_weather", {"city": "Paris"})),
        ("text", '<tool_call>{"name": "nope"}</tool_call>'),
        ("tool_use", ("get_time", {"tz": "UTC"})),
    ]


def test_output_without_calls_is_unchanged():
    for text in ["", "\n", "  ", "plain", "  lead and trail \n", "a < b <tool but no call"]:
        assert shape(split(text, NAMES)) == [("text", text)]


def test_a_tag_split_across_pieces_is_held_until_known():
    parser = ToolCallParser(NAMES)
    assert shape(parser.feed("Checking <tool")) == [("text", "Checking ")]
    assert parser.feed('_call>\n{"name": "get_weather",') == []
    assert parser.feed(' "arguments": {"city": "Paris"}}\n</tool_') == []
    assert shape(parser.feed("call>")) == [("tool_use", ("get_weather", {"city": "Paris"}))]
    assert parser.feed("\n") == []  # whitespace after a call waits for real text
    assert shape(parser.feed("done")) == [("text", "\ndone")]
    assert parser.finish() == []


def test_a_prefix_that_turns_out_not_to_be_a_tag_goes_out_as_text():
    parser = ToolCallParser(NAMES)
    assert shape(parser.feed("a <")) == [("text", "a ")]
    assert shape(parser.feed("tool_x> b")) == [("text", "<tool_x> b")]
    assert shape(parser.feed("<")) == []
    assert shape(parser.finish()) == [("text", "<")]


def test_every_single_character_split_gives_the_same_blocks():
    text = "Sure.\n" + WEATHER + "\n" + TIME + "\nbad: <tool_call>{</tool_call> <tool_ca"
    assert merged(fed(list(text))) == shape(split(text, NAMES))


@given(
    st.lists(
        st.sampled_from(["Hi ", "\n", WEATHER, TIME, "<tool_call>{oops}</tool_call>", "<", "é"]),
        max_size=6,
    ),
    st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=50),
)
def test_any_split_into_pieces_gives_the_same_blocks(chunks, cuts):
    text = "".join(chunks)
    pieces, i, k = [], 0, 0
    while i < len(text):
        step = cuts[k % len(cuts)]
        pieces.append(text[i : i + step])
        i, k = i + step, k + 1
    assert merged(fed(pieces)) == shape(split(text, NAMES))
    # With no acceptable call in it, the text comes back unchanged, in one block.
    if WEATHER not in text and TIME not in text:
        assert shape(split(text, NAMES)) == [("text", text)]


def _request(**kw: object) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **kw}
    )


def test_offered_tools():
    tool = {"name": "get_time", "input_schema": {"type": "object"}}
    assert offered(_request()) is None
    assert offered(_request(tools=[])) is None
    assert offered(_request(tools=[tool])) == frozenset({"get_time"})
    assert offered(_request(tools=[tool], tool_choice={"type": "auto"})) == {"get_time"}
    assert offered(_request(tools=[tool], tool_choice={"type": "none"})) is None


TOOL = {"name": "get_weather", "input_schema": {"type": "object"}}


def test_forcing_opens_the_call_that_tool_choice_asks_for():
    named = forcing(_request(tools=[TOOL], tool_choice={"type": "tool", "name": "get_weather"}))
    assert named.prefix == '<tool_call>\n{"name": "get_weather", "arguments": {'
    assert named.stop == CLOSE
    anyone = forcing(_request(tools=[TOOL], tool_choice={"type": "any"}))
    assert anyone.prefix == '<tool_call>\n{"name": "' and anyone.stop == CLOSE
    for choice in (None, {"type": "auto"}, {"type": "none"}):
        assert forcing(_request(tools=[TOOL], tool_choice=choice)) is NO_FORCING
    # The model finishes the call; the stop string it was stopped at closes it again.
    text, reason, seq = named.settle('"city": "Paris"}}\n', "stop_sequence", CLOSE)
    assert shape(split(text, NAMES)) == [("tool_use", ("get_weather", {"city": "Paris"}))]
    assert (reason, seq) == ("end_turn", None)
    # A client's own stop string still reads as one; other endings pass through.
    assert named.settle("x", "stop_sequence", "STOP")[1:] == ("stop_sequence", "STOP")
    assert named.settle("x", "max_tokens", None) == (named.prefix + "x", "max_tokens", None)


def test_forcing_leaves_a_full_stop_list_alone():
    full = [f"s{i}" for i in range(16)]
    body = _request(tools=[TOOL], tool_choice={"type": "any"}, stop_sequences=full)
    assert forcing(body).stop is None
    mine = _request(tools=[TOOL], tool_choice={"type": "any"}, stop_sequences=[CLOSE])
    assert forcing(mine).stop is None  # the client's own: it stays a stop_sequence


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tool_choice": {"type": "any"}}, "needs at least one tool"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "needs tool_choice.name"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "launch"}},
            "'launch' is not one of the tools",
        ),
    ],
)
def test_forcing_refuses_what_it_cannot_honour(kw, message):
    with pytest.raises(ValueError, match=message):
        forcing(_request(**kw))
