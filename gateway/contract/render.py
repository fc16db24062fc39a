"""Canonical rendering of a Messages request into tokens, with one span per content block.

Order is fixed: tools, then system, then messages (contract §3). Each piece is encoded
on its own and concatenated, so the same request always gives the same tokens, and
a content block's span is exact: a breakpoint is simply the end of its block's span.
"""

from __future__ import annotations

from array import array
from typing import Any, Protocol

from cachepoint.gateway.contract import context_edits
from cachepoint.gateway.contract.blocks import (
    block_text,
    cacheable_block,
    canonical_json,
    rendered_block,
)
from cachepoint.gateway.contract.deferred import expand_references, is_deferred
from cachepoint.gateway.contract.encoding import encode_pieces
from cachepoint.gateway.contract.prompt import (
    BlockSpan,
    RenderableRequest,
    RenderedPrompt,
    Section,
    Tokenizer,
)
from cachepoint.gateway.errors import invalid
from cachepoint.gateway.schemas.messages import (
    CacheControl,
    DocumentBlock,
    ImageBlock,
    ToolResultBlock,
)

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


class PromptTemplate(Protocol):
    """A renderer through a model's own chat template (contract/template.py's)."""

    def render(self, request: RenderableRequest, limit: int | None = None) -> RenderedPrompt:
        """The prompt, or ``PromptTooLong`` once it is known to pass ``limit`` tokens."""
        ...


class Renderer:
    """Renders requests with one tokenizer. With a ``template`` (a real model's chat
    template, contract/template.py, whose ``build_renderer`` builds the gateway's),
    through it. Without one, canonically: role markers are the tokenizer's special
    tokens when it has them (the byte tokenizer does), else short text markers."""

    def __init__(self, tokenizer: Tokenizer, template: PromptTemplate | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template  # renders every request when set
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
                canonical_json(spec),
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
                    skip(path, "messages", block.type, cacheable_block(block), block.cache_control)
                    continue
                add(
                    path,
                    "messages",
                    block.type,
                    block_text(block),
                    cacheable_block(block),
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
