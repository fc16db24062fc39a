"""How each content block reaches the prompt: its canonical text, whether it is
rendered at all, and whether it may carry ``cache_control``.

Both renderers (render.py's canonical layout, template.py's chat templates) give a
block the same text, so these live below both.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from cachepoint.gateway.schemas.messages import (
    ContentBlock,
    DocumentBlock,
    ImageBlock,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)


def canonical_json(obj: Any) -> str:
    """Compact JSON with sorted keys: the same value always gives the same text."""
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
        return f"[tool_use {block.name} id={block.id}] {canonical_json(block.input)}"
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


def cacheable_block(block: ContentBlock) -> bool:
    """Whether a block may carry ``cache_control`` (not thinking, not empty text)."""
    if isinstance(block, ThinkingBlock | RedactedThinkingBlock):
        return False
    return not (isinstance(block, TextBlock) and block.text == "")
