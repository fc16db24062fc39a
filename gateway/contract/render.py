"""Canonical rendering of a Messages request into tokens, with one span per content block.

Order is fixed: tools, then system, then messages (contract §3). Each piece is encoded
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

from ..errors import invalid
from ..schemas.messages import (
    CacheControl,
    ContentBlock,
    DocumentBlock,
    ImageBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from . import context_edits
from .deferred import expand_references, is_deferred
from .encoding import encode_pieces

if TYPE_CHECKING:
    from .context_edits import AppliedEdit
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
    # context_management edits that changed the prompt; None: the request asked for none
    applied_edits: tuple[AppliedEdit, ...] | None = None

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


def block_text(block: ContentBlock | ToolReferenceBlock) -> str:
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
    if isinstance(block, ThinkingBlock | RedactedThinkingBlock):
        return ""  # never rendered (see ``rendered_block``)
    if isinstance(block, ToolReferenceBlock):  # not expanded (deferred.py): its name
        return f"[tool_reference {block.tool_name}]"
    raise TypeError(f"unknown content block {block!r}")


def rendered_block(block: ContentBlock) -> bool:
    """Whether a block reaches the prompt. NOTE: thinking never does: the models served
    here have no reasoning mode, and a replayed block is another model's reasoning (or
    empty, with ``display: omitted``). Dropped in every turn alike, it leaves a
    zero-length span, so the prefix of turn n+1 is turn n's whatever thinking the
    history carries, and ``clear_thinking`` edits change no token."""
    return not isinstance(block, ThinkingBlock | RedactedThinkingBlock)


DEGRADED_HEADER = "cachepoint-degraded"


def degraded(request: RenderableRequest) -> tuple[str, ...]:
    """What the prompt holds only as a placeholder (``images``, ``documents``), for the
    ``cachepoint-degraded`` header. A text document (text or content source) is
    rendered in full and is not degraded. NOTE: a placeholder rather than a 400, since
    a history block that fails would fail every later turn of the conversation."""
    images = documents = False
    for msg in request.messages:
        if isinstance(msg.content, str):
            continue
        for block in msg.content:
            inner = block.content if isinstance(block, ToolResultBlock) else None
            for b in [block, *(inner if isinstance(inner, list) else ())]:
                images = images or isinstance(b, ImageBlock)
                documents = documents or (
                    isinstance(b, DocumentBlock) and b.source.type in ("base64", "url")
                )
    return tuple(kind for kind, hit in (("images", images), ("documents", documents)) if hit)


def degraded_headers(request: RenderableRequest) -> dict[str, str]:
    """``{"cachepoint-degraded": "images,documents"}`` (what was degraded), or {}."""
    kinds = degraded(request)
    return {DEGRADED_HEADER: ",".join(kinds)} if kinds else {}


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

    def render(self, request: RenderableRequest, limit: int | None = None) -> RenderedPrompt:
        """The prompt for ``request``: its ``tool_reference`` blocks expanded
        (contract/deferred.py), then its ``context_management`` edits applied
        (contract/context_edits.py), then rendered. A ``context_management`` that
        cannot be applied is a 400. Past ``limit`` tokens, ``PromptTooLong`` as soon as
        that is known (contract/encoding.py): tokenizing stops there."""
        request = expand_references(request)

        def render(req: RenderableRequest) -> RenderedPrompt:
            return self._render(req, limit)

        try:
            edited = context_edits.apply(request, render)
        except context_edits.ContextEditError as exc:
            raise invalid(str(exc)) from exc
        out = edited.rendered if edited.rendered is not None else render(edited.request)
        if edited.applied is None:
            return out
        return RenderedPrompt(out.tokens, out.blocks, edited.applied)

    def _render(self, request: RenderableRequest, limit: int | None = None) -> RenderedPrompt:
        if self.template is not None:
            return self.template.render(request, limit)
        # NOTE: two passes: the blocks' texts are collected, then encoded in one bounded
        # call (encoding.py), then laid out with their headers.
        texts: list[str] = []
        # (path, section, kind, cacheable, marker, header, index in texts or -1: skipped)
        laid: list[tuple[str, Section, str, bool, Any, list[int], int]] = []
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
            laid.append((path, section, kind, cacheable, cc, header, len(texts)))
            texts.append(text)

        def skip(path: str, section: Section, kind: str, cacheable: bool, cc: Any) -> None:
            # NOTE: a block that does not reach the prompt still has its span, empty,
            # where it stands: a breakpoint on it caches what precedes it.
            laid.append((path, section, kind, cacheable, cc, [], -1))

        for i, tool in enumerate(request.tools or ()):
            if is_deferred(tool):  # never in the tools section (contract/deferred.py)
                skip(f"tools.{i}", "tools", "tool", True, tool.cache_control)
                continue
            spec = tool.model_dump(exclude={"cache_control", "defer_loading"}, exclude_none=True)
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
            opened = False  # the role header goes before the turn's first rendered block
            for k, block in enumerate(msg.content):
                path = f"messages.{m}.content.{k}"
                if not rendered_block(block):
                    skip(path, "messages", block.type, _cacheable(block), block.cache_control)
                    continue
                add(
                    path,
                    "messages",
                    block.type,
                    block_text(block),
                    _cacheable(block),
                    block.cache_control,
                    [] if opened else role,
                )
                opened = True
        encoded = encode_pieces(self.tokenizer, texts, limit)
        toks: list[int] = list(self._bos)
        spans: list[BlockSpan] = []
        for path, section, kind, cacheable, cc, header, i in laid:
            if i < 0:
                spans.append(BlockSpan(path, section, kind, len(toks), len(toks), cacheable, cc))
                continue
            toks.extend(header)
            start = len(toks)
            toks.extend(encoded[i])
            toks.extend(sep)
            spans.append(BlockSpan(path, section, kind, start, len(toks), cacheable, cc))
        toks.extend(self._marks["assistant"])  # the generation prompt
        return RenderedPrompt(array("i", toks), tuple(spans))
