"""OpenAI's streams, written by the same relay as the Messages API's
(`gateway/streaming.py`): ``data: {chunk}`` lines, a last chunk with the usage when
``stream_options.include_usage`` asks for it, then ``data: [DONE]``. An error after the
stream started is OpenAI's bare error object (the SDK raises it as an APIError), and
an idle stream is kept open with SSE comments, which the SDK skips."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from cachepoint.billing import Buckets
from cachepoint.gateway.contract.openai import finish_reason
from cachepoint.gateway.contract.toolcalls import Part, TextPart
from cachepoint.gateway.errors import openai_envelope

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"


def data(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def openai_usage(b: Buckets) -> dict[str, Any]:
    """OpenAI's usage for the four billed buckets: cached tokens are the reads; the
    prompt counts all of them."""
    prompt = b.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": b.output_tokens,
        "total_tokens": prompt + b.output_tokens,
        "prompt_tokens_details": {"cached_tokens": b.cache_read_input_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


@dataclass(slots=True)
class _Chunks:
    """What both of OpenAI's streams share: the id, the usage chunk, [DONE], errors."""

    id: str  # chatcmpl-... or cmpl-...
    model: str  # the served model (aliases resolved)
    include_usage: bool  # stream_options.include_usage
    ping: bytes = PING
    tool_calls: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    object_name = "chat.completion.chunk"

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last
        return out

    def close(self) -> list[bytes]:
        return []

    def _end(self, last_choice: dict[str, Any], b: Buckets) -> list[bytes]:
        out = [data(self._chunk([last_choice]))]
        if self.include_usage:
            out.append(data({**self._chunk([]), "usage": openai_usage(b)}))
        return [*out, DONE]

    def error(self, kind: str, message: str) -> bytes:
        return data(openai_envelope(kind, message))


@dataclass(slots=True)
class ChatChunks(_Chunks):
    """``chat.completion.chunk`` objects: the role first, then content deltas, tool
    calls (each whole, in one delta), then the finish reason."""

    def opening(self, start: Buckets) -> list[bytes]:
        delta = {"role": "assistant", "content": "", "refusal": None}
        return [data(self._chunk([_choice(delta)]))]

    def part(self, part: Part) -> list[bytes]:
        if isinstance(part, TextPart):
            if not part.text:
                return []
            return [data(self._chunk([_choice({"content": part.text})]))]
        call = {
            "index": self.tool_calls,
            "id": part.id,
            "type": "function",
            "function": {
                "name": part.name,
                "arguments": json.dumps(part.input, separators=(",", ":"), ensure_ascii=False),
            },
        }
        self.tool_calls += 1
        return [data(self._chunk([_choice({"tool_calls": [call]})]))]

    def closing(
        self, stop_reason: str | None, stop_sequence: str | None, b: Buckets
    ) -> list[bytes]:
        reason = finish_reason(stop_reason, self.tool_calls > 0)
        return self._end(_choice({}, reason), b)


@dataclass(slots=True)
class TextChunks(_Chunks):
    """The legacy completions stream: ``text_completion`` objects with text deltas."""

    object_name = "text_completion"

    def opening(self, start: Buckets) -> list[bytes]:
        return []

    def part(self, part: Part) -> list[bytes]:
        assert isinstance(part, TextPart)  # no tools on this endpoint
        if not part.text:
            return []
        return [data(self._chunk([_text_choice(part.text)]))]

    def closing(
        self, stop_reason: str | None, stop_sequence: str | None, b: Buckets
    ) -> list[bytes]:
        return self._end(_text_choice("", finish_reason(stop_reason, False)), b)


def _choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _text_choice(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
