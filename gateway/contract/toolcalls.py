"""Tool calls in the model's output text, as Messages API ``tool_use`` blocks.

ChatML/Qwen-style models call a tool by writing
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, possibly several times and
possibly after some text. ``ToolCallParser`` reads that text incrementally (token
texts as they arrive), so a stream can relay plain text at once and still turn a call
into a ``tool_use`` block; ``split`` runs the same parser over a whole text, so a
streamed and a collected answer always have the same blocks.

A call is accepted only if its JSON parses to an object naming a tool the request
declared, with an object (or a JSON string holding one) as its arguments; anything
else (unknown tool, malformed JSON, an unclosed tag) stays plain text.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from cachepoint.gateway.contract.deferred import callable_names
from cachepoint.gateway.schemas.messages import CountTokensRequest, MessagesRequest

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_ID_CHARS = string.ascii_letters + string.digits


def new_tool_use_id() -> str:
    """``toolu_`` and 24 random base62 characters, the shape of Anthropic's ids."""
    return "toolu_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def offered(body: MessagesRequest) -> frozenset[str] | None:
    """The tool names a call may use; None when the output is not parsed at all
    (no tools declared, or ``tool_choice: none``). A deferred tool counts only once the
    history has loaded it (contract/deferred.py): until then the model was never shown
    it, and Anthropic's model cannot call it either, so text naming it stays text."""
    if not body.tools or (body.tool_choice is not None and body.tool_choice.type == "none"):
        return None
    return callable_names(body.tools, body.messages)


@dataclass(frozen=True, slots=True)
class Forcing:
    """How the gateway holds a model to ``tool_choice: any`` or ``tool``.

    The instruction in the system turn is not enough for a small model (SmolLM2-135M
    answers in prose), so the answer is started for it: the prompt ends with the
    opening of a call, ``<tool_call>`` and the JSON up to the tool's name (``any``) or
    into its arguments (``tool``), and the replica stops at ``</tool_call>``. The
    gateway parses ``prefix`` + the replica's text (+ the stop string it consumed),
    so the call comes back as a ``tool_use`` block, or as plain text if the model
    still wrote something that is not a call.
    """

    prefix: str  # the answer's opening, already at the end of the prompt
    stop: str | None  # the stop string the gateway added for the replica, if any

    def settle(
        self, text: str, stop_reason: str | None, stop_sequence: str | None
    ) -> tuple[str, str | None, str | None]:
        """The whole answer text and the stop fields the client may see."""
        text = self.prefix + text
        if self.stop is not None and stop_sequence == self.stop:
            # NOTE: the client never asked for this stop string: it ends the turn.
            return text + self.stop, "end_turn", None
        return text, stop_reason, stop_sequence


NO_FORCING = Forcing("", None)


def _first_argument(schema: dict[str, Any]) -> str:
    """How every call that fits ``schema`` may begin inside its arguments object: the
    first required property's key (and the quote of a string value), or nothing.

    NOTE: any conforming call has that key, so starting with it excludes none of them
    (up to key order); it keeps a small model from describing the tool instead of
    calling it (SmolLM2-135M wrote ``"type": "function", ...`` without it, and
    ``"city": 12`` without the quote).
    """
    required = schema.get("required")
    properties = schema.get("properties")
    if not isinstance(required, list) or not required or not isinstance(properties, dict):
        return ""
    key = required[0]
    if not isinstance(key, str) or not isinstance(properties.get(key), dict):
        return ""
    quote = '"' if properties[key].get("type") == "string" else ""
    return f"{json.dumps(key, ensure_ascii=False)}: {quote}"


def forcing(body: MessagesRequest | CountTokensRequest) -> Forcing:
    """The forcing ``body.tool_choice`` asks for; ``ValueError`` for a choice that
    cannot be honoured (no tools, or a tool that is not declared)."""
    choice = body.tool_choice
    if choice is None or choice.type in ("auto", "none"):
        return NO_FORCING
    names = [tool.name for tool in body.tools or []]
    if not names:
        raise ValueError(f"tool_choice.type {choice.type!r} needs at least one tool in tools")
    if choice.type == "tool":
        if not choice.name:
            raise ValueError("tool_choice.type 'tool' needs tool_choice.name")
        if choice.name not in names:
            raise ValueError(f"tool_choice.name {choice.name!r} is not one of the tools")
        name = json.dumps(choice.name, ensure_ascii=False)
        tool = next(t for t in body.tools or [] if t.name == choice.name)
        first = _first_argument(tool.input_schema)
        prefix = f'{OPEN}\n{{"name": {name}, "arguments": {{{first}'
    else:
        prefix = f'{OPEN}\n{{"name": "'
    # NOTE: the replica takes 16 stop strings, as many as a client may send; with 16
    # already the call is parsed wherever it ends, and what follows stays text.
    taken = getattr(body, "stop_sequences", None) or []  # count_tokens has none
    stop = CLOSE if CLOSE not in taken and len(taken) < 16 else None
    return Forcing(prefix, stop)


@dataclass(frozen=True, slots=True)
class TextPart:
    """Text for the current text block (a new block starts if none is open)."""

    text: str  # may be empty: an empty output still has its one text block


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One accepted call: a ``tool_use`` block of its own."""

    id: str  # toolu_...
    name: str  # a declared tool's name
    input: dict[str, Any]  # the call's arguments


Part = TextPart | ToolCall


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_call(inner: str, names: frozenset[str]) -> ToolCall | None:
    """The call between the tags, or None when it is not an acceptable call."""
    try:
        obj = json.loads(inner, parse_constant=_no_constant)
        if not isinstance(obj, dict):
            return None
        name, args = obj.get("name"), obj.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args, parse_constant=_no_constant)
        if not isinstance(name, str) or name not in names or not isinstance(args, dict):
            return None
        # NOTE: a lone surrogate ("\ud800") is valid JSON but cannot be sent as UTF-8.
        json.dumps(args, ensure_ascii=False).encode()
    except (ValueError, RecursionError, UnicodeEncodeError):
        return None
    return ToolCall(new_tool_use_id(), name, args)


def _held_prefix(text: str) -> int:
    """Length of the longest end of ``text`` that may be the start of ``OPEN``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class ToolCallParser:
    """Feed it the output text piece by piece; it returns the parts ready to go out.

    Text that could be the start of ``<tool_call>`` is held back until it is not
    (like a stop string's prefix), and a call is held until its closing tag. Whitespace
    that would open a text block is held too: the newlines between two calls, or after
    the last one, make no empty-looking text block (an output with no call at all is
    returned unchanged)."""

    names: frozenset[str]  # the declared tools
    buf: str = ""  # held text: a possible tag prefix, or the body of an open call
    in_call: bool = False  # inside <tool_call> ... (buf is the call so far)
    text_open: bool = False  # a text part went out since the last call
    blank: str = ""  # whitespace held until a text block is known to be needed
    emitted: bool = False  # any part went out
    calls: int = 0  # accepted calls
    _parts: list[Part] = field(default_factory=list)  # parts of the current feed

    def feed(self, text: str) -> list[Part]:
        self.buf += text
        while True:
            if self.in_call:
                end = self.buf.find(CLOSE)
                if end < 0:
                    break
                inner, self.buf = self.buf[:end], self.buf[end + len(CLOSE) :]
                self.in_call = False
                call = parse_call(inner, self.names)
                if call is None:
                    self._text(OPEN + inner + CLOSE)
                else:
                    self._call(call)
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                self._text(self.buf[:start])
                self.buf, self.in_call = self.buf[start + len(OPEN) :], True
                continue
            keep = _held_prefix(self.buf)
            self._text(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            break
        return self._take()

    def finish(self) -> list[Part]:
        """The end of the output: what is still held goes out as text."""
        rest = (OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        self._text(rest)
        if not self.emitted:
            self._parts.append(TextPart(self.blank))
            self.emitted = True
        self.blank = ""
        return self._take()

    def _text(self, text: str) -> None:
        if not text:
            return
        if not self.text_open:
            if not text.strip():
                self.blank += text
                return
            text, self.blank = self.blank + text, ""
            self.text_open = True
        self._parts.append(TextPart(text))
        self.emitted = True

    def _call(self, call: ToolCall) -> None:
        self.blank, self.text_open = "", False
        self._parts.append(call)
        self.emitted = True
        self.calls += 1

    def _take(self) -> list[Part]:
        parts, self._parts = self._parts, []
        return parts


def split(text: str, names: frozenset[str]) -> list[Part]:
    """A whole output as blocks: text parts merged, one part per block."""
    parser = ToolCallParser(names)
    blocks: list[Part] = []
    for part in parser.feed(text) + parser.finish():
        if isinstance(part, TextPart) and blocks and isinstance(blocks[-1], TextPart):
            blocks[-1] = TextPart(blocks[-1].text + part.text)
        else:
            blocks.append(part)
    return blocks
