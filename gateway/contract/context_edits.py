"""``context_management`` edits: what the model sees of a long history (Anthropic's
context editing), applied to the parsed request before it is rendered.

Two strategies, as Anthropic documents them (build-with-claude/context-editing):

- ``clear_tool_uses_20250919``: once the prompt exceeds ``trigger`` (default 100,000
  input tokens; or a number of ``tool_uses``), every tool use but the ``keep`` most
  recent (default 3) has its result replaced by ``CLEARED_RESULT``, oldest first;
  ``exclude_tools`` are never cleared (they still count among the kept); with
  ``clear_tool_inputs`` (true, or a list of tool names) the call's input is cleared
  too. If that clears fewer than ``clear_at_least`` input tokens, nothing is cleared.
- ``clear_thinking_20251015``: thinking blocks are kept only in the ``keep`` most
  recent assistant turns that have any (``"all"``: every turn). It must be listed
  first. NOTE: the models served here have no reasoning mode and the renderer never
  puts thinking into the prompt (blocks.py), so clearing it changes no token: the
  edit is reported with ``cleared_input_tokens: 0``.

The client keeps its full history and resends it; the edit is recomputed on every
request, so the same history always gives the same prompt.

Effect on the cache (docs/gateway.md, "Context management"): clearing rewrites history
in place, so the prompt is the same as the previous turn's up to the first cleared
block, and differs from there on. A breakpoint before that block still reads its
entry; everything after it is computed and written again, once: the next turn clears
the same blocks (and keeps reading), until the trigger clears more. That is why
``clear_at_least`` exists.

Pure functions over the parsed request; token counts come from the ``render`` callable
the caller passes (the gateway's renderer), so they are exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

CLEAR_TOOL_USES = "clear_tool_uses_20250919"
CLEAR_THINKING = "clear_thinking_20251015"
CLEARED_RESULT = "[tool result cleared by context management]"
DEFAULT_TRIGGER_INPUT_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1
_THINKING = ("thinking", "redacted_thinking")

P = TypeVar("P", bound=Sized)


class ContextEditError(ValueError):
    """A ``context_management`` this gateway cannot apply: a 400 naming the path."""


@dataclass(frozen=True, slots=True)
class AppliedEdit:
    """One edit that changed the request, as ``context_management.applied_edits`` says."""

    type: str  # the strategy, e.g. clear_tool_uses_20250919
    cleared_input_tokens: int  # prompt tokens before minus after
    cleared_tool_uses: int | None = None  # clear_tool_uses: tool uses cleared
    cleared_thinking_turns: int | None = None  # clear_thinking: assistant turns cleared

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.cleared_tool_uses is not None:
            out["cleared_tool_uses"] = self.cleared_tool_uses
        if self.cleared_thinking_turns is not None:
            out["cleared_thinking_turns"] = self.cleared_thinking_turns
        out["cleared_input_tokens"] = self.cleared_input_tokens
        return out


@dataclass(frozen=True, slots=True)
class Edited(Generic[P]):
    request: Any  # the request the model sees (the input itself when nothing changed)
    applied: tuple[AppliedEdit, ...] | None  # None: the request asked for no edits
    rendered: P | None  # ``render(request)`` when one was made on the way, else None


def report(applied: tuple[AppliedEdit, ...] | None) -> dict[str, Any] | None:
    """The response's ``context_management`` (JSON, and the stream's last
    ``message_delta``); None when the request asked for no edits."""
    return None if applied is None else {"applied_edits": [e.as_dict() for e in applied]}


def _get(obj: Any, name: str) -> Any:
    """A field of a parsed edit (a model, or a plain dict)."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _value(
    obj: Any, path: str, kinds: tuple[str, ...], default: tuple[str, int]
) -> tuple[str, int]:
    """``(type, value)`` of a ``{"type": ..., "value": n}`` setting, or ``default``."""
    if obj is None:
        return default
    kind, value = _get(obj, "type"), _get(obj, "value")
    if kind not in kinds:
        raise ContextEditError(f"{path}.type: expected one of {', '.join(kinds)}, got {kind!r}")
    if type(value) is not int or value < 0:
        raise ContextEditError(f"{path}.value: expected a non-negative integer")
    return kind, value


def edits_of(request: Any) -> list[Any] | None:
    """The request's edits in order; None when it has no ``context_management``."""
    cm = getattr(request, "context_management", None)
    if cm is None:
        return None
    edits = list(_get(cm, "edits") or ())
    seen: set[str] = set()
    for i, edit in enumerate(edits):
        kind = _get(edit, "type")
        path = f"context_management.edits.{i}"
        if kind not in (CLEAR_TOOL_USES, CLEAR_THINKING):
            raise ContextEditError(f"{path}.type: unknown context management edit {kind!r}")
        if kind in seen:
            raise ContextEditError(f"{path}: {kind} may be listed only once")
        if kind == CLEAR_THINKING and seen:
            raise ContextEditError(
                f"{path}: {CLEAR_THINKING} must be listed first in context_management.edits"
            )
        seen.add(kind)
    return edits


def apply(request: Any, render: Callable[[Any], P]) -> Edited[P]:
    """The request after its ``context_management`` edits, and the edits that applied."""
    edits = edits_of(request)
    if not edits:
        return Edited(request, None if edits is None else (), None)
    applied: list[AppliedEdit] = []
    rendered: P | None = None
    for i, edit in enumerate(edits):
        path = f"context_management.edits.{i}"
        if _get(edit, "type") == CLEAR_THINKING:
            request, done, rendered = _clear_thinking(request, edit, path, render, rendered)
        else:
            request, done, rendered = _clear_tool_uses(request, edit, path, render, rendered)
        if done is not None:
            applied.append(done)
    return Edited(request, tuple(applied), rendered)


def _with_blocks(request: Any, changes: dict[tuple[int, int], Any]) -> Any:
    """``request`` with content block (message, index) replaced, paths unchanged."""
    messages = list(request.messages)
    for m in sorted({m for m, _ in changes}):
        blocks = list(messages[m].content)
        for (mm, k), block in changes.items():
            if mm == m:
                blocks[k] = block
        messages[m] = messages[m].model_copy(update={"content": blocks})
    return request.model_copy(update={"messages": messages})


def _measured(
    before: Any,
    after: Any,
    render: Callable[[Any], P],
    rendered: P | None,
) -> tuple[int, P]:
    """Tokens the edit removed, and the edited request's render."""
    size = len(rendered) if rendered is not None else len(render(before))
    out = render(after)
    # NOTE: a result shorter than the placeholder can make the prompt longer; the
    # count is "cleared", never negative (the SDKs type it as a non-negative integer).
    return max(0, size - len(out)), out


def _clear_thinking(
    request: Any, edit: Any, path: str, render: Callable[[Any], P], rendered: P | None
) -> tuple[Any, AppliedEdit | None, P | None]:
    keep = _get(edit, "keep")
    if keep == "all" or _get(keep, "type") == "all":
        return request, None, rendered
    _, n = _value(keep, f"{path}.keep", ("thinking_turns",), ("", DEFAULT_KEEP_THINKING_TURNS))
    if n < 1:
        raise ContextEditError(f'{path}.keep.value: must be at least 1 (or keep: "all")')
    turns = [
        m
        for m, msg in enumerate(request.messages)
        if msg.role == "assistant"
        and not isinstance(msg.content, str)
        and any(b.type in _THINKING for b in msg.content)
    ]
    cleared = turns[: max(0, len(turns) - n)]
    if not cleared:
        return request, None, rendered
    changes: dict[tuple[int, int], Any] = {}
    for m in cleared:
        for k, block in enumerate(request.messages[m].content):
            # NOTE: emptied in place rather than removed, so later block paths hold.
            if block.type == "thinking":
                changes[(m, k)] = block.model_copy(update={"thinking": ""})
            elif block.type == "redacted_thinking":
                changes[(m, k)] = block.model_copy(update={"data": ""})
    edited = _with_blocks(request, changes)
    tokens, out = _measured(request, edited, render, rendered)
    return edited, AppliedEdit(CLEAR_THINKING, tokens, cleared_thinking_turns=len(cleared)), out


def _clears_input(option: Any, name: str) -> bool:
    if isinstance(option, list | tuple | set | frozenset):
        return name in option
    return option is True


def _clear_tool_uses(
    request: Any, edit: Any, path: str, render: Callable[[Any], P], rendered: P | None
) -> tuple[Any, AppliedEdit | None, P | None]:
    uses: list[tuple[int, int, Any]] = []  # (message, block, tool_use), oldest first
    results: dict[str, list[tuple[int, int, Any]]] = {}  # tool_use id -> its results
    for m, msg in enumerate(request.messages):
        if isinstance(msg.content, str):
            continue
        for k, block in enumerate(msg.content):
            if block.type == "tool_use" and msg.role == "assistant":
                uses.append((m, k, block))
            elif block.type == "tool_result" and msg.role == "user":
                results.setdefault(block.tool_use_id, []).append((m, k, block))
    trigger_kind, threshold = _value(
        _get(edit, "trigger"),
        f"{path}.trigger",
        ("input_tokens", "tool_uses"),
        ("input_tokens", DEFAULT_TRIGGER_INPUT_TOKENS),
    )
    if trigger_kind == "tool_uses":
        if len(uses) <= threshold:
            return request, None, rendered
    else:
        rendered = rendered if rendered is not None else render(request)
        if len(rendered) <= threshold:
            return request, None, rendered
    _, keep = _value(
        _get(edit, "keep"), f"{path}.keep", ("tool_uses",), ("tool_uses", DEFAULT_KEEP_TOOL_USES)
    )
    _, at_least = _value(
        _get(edit, "clear_at_least"), f"{path}.clear_at_least", ("input_tokens",), ("", 0)
    )
    exclude = set(_get(edit, "exclude_tools") or ())
    inputs = _get(edit, "clear_tool_inputs")
    changes: dict[tuple[int, int], Any] = {}
    count = 0
    for m, k, use in uses[: max(0, len(uses) - keep)]:
        if use.name in exclude:
            continue
        changed = False
        for rm, rk, result in results.get(use.id, ()):
            if result.content not in (None, "", [], CLEARED_RESULT):  # nothing to clear
                changes[(rm, rk)] = result.model_copy(update={"content": CLEARED_RESULT})
                changed = True
        if _clears_input(inputs, use.name) and use.input:
            changes[(m, k)] = use.model_copy(update={"input": {}})
            changed = True
        count += changed
    if not changes:
        return request, None, rendered
    edited = _with_blocks(request, changes)
    tokens, out = _measured(request, edited, render, rendered)
    if tokens < at_least:
        # Documented: an edit that cannot clear clear_at_least tokens is not applied,
        # so the cached prefix is not broken for too little.
        return request, None, rendered
    return edited, AppliedEdit(CLEAR_TOOL_USES, tokens, cleared_tool_uses=count), out
