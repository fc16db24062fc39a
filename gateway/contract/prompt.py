"""What rendering reads and what it produces: the request shape, the tokenizer it
encodes with, and the prompt with one span per content block.

Both renderers (the canonical one in render.py, the chat-template one in template.py)
produce a :class:`RenderedPrompt`; the breakpoint planner and the request path read it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from cachepoint.gateway.contract.context_edits import AppliedEdit
from cachepoint.gateway.schemas.messages import CacheControl, TextBlock, Tool

Section = Literal["tools", "system", "messages"]


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def special_id(self, name: str) -> int | None: ...

    @property
    def bos_id(self) -> int | None: ...


class RenderableRequest(Protocol):
    """What rendering reads: MessagesRequest and CountTokensRequest both fit."""

    @property
    def tools(self) -> list[Tool] | None: ...

    @property
    def system(self) -> str | list[TextBlock] | None: ...

    @property
    def messages(self) -> Sequence[Any]: ...


@dataclass(frozen=True, slots=True)
class BlockSpan:
    """Where one content block landed in the token stream."""

    path: str  # JSON path in the request, e.g. "messages.3.content.1"
    section: Section  # tools | system | messages
    kind: str  # tool, text, image, document, tool_use, tool_result, thinking, ...
    start: int  # first token of the block
    end: int  # one past its last token: where a breakpoint on it sits
    cacheable: bool  # may carry cache_control (not thinking, not empty text)
    cache_control: CacheControl | None  # the marker on it, if any


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    tokens: array[int]  # int32 token ids, ready for kvcore hashing
    blocks: tuple[BlockSpan, ...]  # in render order
    # context_management edits that changed the prompt; None: the request asked for none
    applied_edits: tuple[AppliedEdit, ...] | None = None

    def __len__(self) -> int:
        return len(self.tokens)
