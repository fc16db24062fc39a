"""Canonical rendering of a Messages request into tokens, with one span per content block.

Order is fixed: tools, then system, then messages (DESIGN §3). Each piece is encoded
on its own and concatenated, so the same request always gives the same tokens, and
a content block's span is exact: a breakpoint is simply the end of its block's span.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ..schemas.messages import (
    CacheControl,
    ContentBlock,
    DocumentBlock,
    ImageBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolResultBlock,
    ToolUseBlock,
)

if TYPE_CHECKING:
    from .template import TemplateRenderer

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

    def __len__(self) -> int:
        return len(self.tokens)


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _digest(data: str) -> str:
    return hashlib.sha256(data.encode()).hexdigest()[:32]


def _source_text(source: Any) -> str:
    kind = source.type
    if kind == "base64":
        return f"{source.media_type} sha256:{_digest(source.data)}"
    if kind == "url":
        return f"url sha256:{_digest(source.url)}"
    if kind == "text":
        return str(source.data)
    content = source.content
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def tool_result_body(block: ToolResultBlock) -> str:
    """A tool result's content as text: a string as is, blocks one per line."""
    content = block.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(block_text(c) for c in content)


def block_text(block: ContentBlock) -> str:
    """The canonical text of one content block (what its tokens encode)."""
    if isinstance(block, TextBlock):
        return block.text
    if isinstance(block, ImageBlock):
        return f"[image {_source_text(block.source)}]"
    if isinstance(block, DocumentBlock):
        title = f" title={block.title}" if block.title else ""
        context = f" context={block.context}" if block.context else ""
        return f"[document{title}{context}] {_source_text(block.source)}"
    if isinstance(block, ToolUseBlock):
        return f"[tool_use {block.name} id={block.id}] {_canonical_json(block.input)}"
    if isinstance(block, ToolResultBlock):
        flag = " error" if block.is_error else ""
        return f"[tool_result id={block.tool_use_id}{flag}] {tool_result_body(block)}"
    if isinstance(block, ThinkingBlock):
        return f"[thinking] {block.thinking}"
    if isinstance(block, RedactedThinkingBlock):
        return f"[redacted_thinking sha256:{_digest(block.data)}]"
    raise TypeError(f"unknown content block {block!r}")


def _cacheable(block: ContentBlock) -> bool:
    if isinstance(block, ThinkingBlock | RedactedThinkingBlock):
        return False
    return not (isinstance(block, TextBlock) and block.text == "")


class Renderer:
    """Renders requests with one tokenizer. With a ``chat_template`` (a real model's),
    through that template (contract/template.py). Without one, canonically: role
    markers are the tokenizer's special tokens when it has them (the byte tokenizer
    does), else short text markers."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template: TemplateRenderer | None = None
        if chat_template is not None:
            from .template import TemplateRenderer

            self.template = TemplateRenderer(tokenizer, chat_template)
        self._marks = {
            name: self._marker(name) for name in ("tool", "system", "user", "assistant", "sep")
        }
        bos = tokenizer.bos_id
        self._bos = [bos] if bos is not None else []

    def _marker(self, name: str) -> list[int]:
        special = self.tokenizer.special_id(f"<|{name}|>")
        if special is not None:
            return [special]
        return self.tokenizer.encode("\n" if name == "sep" else f"\n<{name}>\n")

    def render(self, request: RenderableRequest) -> RenderedPrompt:
        if self.template is not None:
            return self.template.render(request)
        toks: list[int] = list(self._bos)
        spans: list[BlockSpan] = []
        enc = self.tokenizer.encode
        sep = self._marks["sep"]

        def add(
            path: str,
            section: Section,
            kind: str,
            text: str,
            cacheable: bool,
            cc: CacheControl | None,
            header: list[int],
        ) -> None:
            toks.extend(header)
            start = len(toks)
            toks.extend(enc(text))
            toks.extend(sep)
            spans.append(BlockSpan(path, section, kind, start, len(toks), cacheable, cc))

        for i, tool in enumerate(request.tools or ()):
            spec = tool.model_dump(exclude={"cache_control"}, exclude_none=True)
            add(
                f"tools.{i}",
                "tools",
                "tool",
                _canonical_json(spec),
                True,
                tool.cache_control,
                self._marks["tool"],
            )
        system = request.system
        if isinstance(system, str):
            add("system", "system", "text", system, system != "", None, self._marks["system"])
        elif system:
            for j, block in enumerate(system):
                header = self._marks["system"] if j == 0 else []
                add(
                    f"system.{j}",
                    "system",
                    "text",
                    block.text,
                    block.text != "",
                    block.cache_control,
                    header,
                )
        for m, msg in enumerate(request.messages):
            role = self._marks[msg.role]
            if isinstance(msg.content, str):
                add(
                    f"messages.{m}.content",
                    "messages",
                    "text",
                    msg.content,
                    msg.content != "",
                    None,
                    role,
                )
                continue
            for k, block in enumerate(msg.content):
                add(
                    f"messages.{m}.content.{k}",
                    "messages",
                    block.type,
                    block_text(block),
                    _cacheable(block),
                    block.cache_control,
                    role if k == 0 else [],
                )
        toks.extend(self._marks["assistant"])  # the generation prompt
        return RenderedPrompt(array("i", toks), tuple(spans))
