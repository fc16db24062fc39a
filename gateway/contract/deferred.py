"""Deferred tools (``defer_loading: true``) and the ``tool_reference`` blocks that load them.

A client with a large tool catalog (Claude Code's MCP tools) marks most of it deferred
and offers a search tool; the search's ``tool_result`` holds ``tool_reference`` blocks
(``{"type": "tool_reference", "tool_name": ...}``) naming what it found, and from then
on the model may call those tools.

Here (docs/gateway.md, "Deferred tools"):
- a deferred tool is never in the tools section of the prompt, referenced or not;
- a ``tool_reference`` to a deferred tool renders, where it stands in the history, as
  that tool's definition (name, description, input schema as canonical JSON);
- a deferred tool is callable (``callable_names``) once the history references it:
  a ``tool_reference`` naming it, or a ``tool_use`` of it.

NOTE: the definition goes where the reference is, not into the tools section, because
the tools section is the very start of the prompt: loading a tool there would change
every token after it and re-write the whole cached prefix (for Claude Code, tens of
thousands of tokens) on the turn a tool is found. Inline, the history before the
reference is unchanged, so every earlier breakpoint still hits. Anthropic's API expands
references in place for the same reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from cachepoint.gateway.schemas.messages import TextBlock

REFERENCE = "tool_reference"


def is_deferred(tool: Any) -> bool:
    return getattr(tool, "defer_loading", None) is True


def _canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def definition_text(tool: Any) -> str:
    """A loaded tool's definition, as a ``tool_reference`` to it renders."""
    spec: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        spec["description"] = tool.description
    spec["input_schema"] = tool.input_schema
    return f"[tool_reference {tool.name}] {_canonical_json(spec)}"


def _reference_name(block: Any) -> str | None:
    if getattr(block, "type", None) != REFERENCE:
        return None
    name = getattr(block, "tool_name", None)
    return name if isinstance(name, str) else None


def _blocks(messages: Sequence[Any]) -> Iterator[Any]:
    """Every content block of the history, a tool_result's own blocks included."""
    for msg in messages:
        if isinstance(msg.content, str):
            continue
        for block in msg.content:
            yield block
            inner = getattr(block, "content", None) if block.type == "tool_result" else None
            if isinstance(inner, list):
                yield from inner


def referenced(messages: Sequence[Any]) -> frozenset[str]:
    """Tool names the history loads: named by a ``tool_reference`` or called in a ``tool_use``."""
    names: set[str] = set()
    for block in _blocks(messages):
        name = _reference_name(block)
        if name is not None:
            names.add(name)
        elif block.type == "tool_use":
            names.add(block.name)
    return frozenset(names)


def callable_names(tools: Sequence[Any], messages: Sequence[Any]) -> frozenset[str]:
    """The tools a model's call may name: every tool not deferred, and the deferred
    ones the history has loaded (Anthropic: a deferred tool is callable once found)."""
    loaded = referenced(messages) if any(is_deferred(t) for t in tools) else frozenset()
    return frozenset(t.name for t in tools if not is_deferred(t) or t.name in loaded)


def expand_references(request: Any) -> Any:
    """The request with every ``tool_reference`` inside a ``tool_result`` replaced by a
    text block holding the definition of the deferred tool it names (a reference to a
    tool that is not deferred, or not offered, keeps only its name: the tools section
    already has the one, and there is nothing to load for the other).

    NOTE: only the tool_result's own content list changes, so every block path (and
    every span) stays where it was."""
    tools = {t.name: t for t in (request.tools or ()) if is_deferred(t)}
    messages = list(request.messages)
    changed = False
    for m, msg in enumerate(messages):
        if isinstance(msg.content, str):
            continue
        blocks = list(msg.content)
        touched = False
        for k, block in enumerate(blocks):
            inner = block.content if block.type == "tool_result" else None
            if not isinstance(inner, list) or not any(_reference_name(c) for c in inner):
                continue
            items = []
            for c in inner:
                name = _reference_name(c)
                if name is None:
                    items.append(c)
                    continue
                tool = tools.get(name)
                text = definition_text(tool) if tool is not None else f"[tool_reference {name}]"
                items.append(TextBlock(type="text", text=text))
            blocks[k] = block.model_copy(update={"content": items})
            touched = True
        if touched:
            messages[m] = msg.model_copy(update={"content": blocks})
            changed = True
    return request.model_copy(update={"messages": messages}) if changed else request
