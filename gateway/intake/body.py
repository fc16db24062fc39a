"""The request body as JSON, checked before validation: what the parser accepts but the
pipeline cannot handle is a 400 naming the path, never a 500.

Order matters for cost: the JSON is parsed (NaN and Infinity refused: they are not
JSON, and a schema or tool input holding one cannot be rendered back), then the counts
that are cheap to read (messages, content blocks, tools) are checked before the walk
that measures nesting depth, and only then does pydantic validate. A million tiny
blocks is thus refused after ``json.loads`` alone, never validated or rendered.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from cachepoint.gateway.errors import invalid

_M = TypeVar("_M", bound=BaseModel)


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """Documented caps on a Messages body (docs/gateway.md, "Limits")."""

    max_depth: int = 64  # nesting of objects and arrays, the body itself being level 1
    max_messages: int = 20_000  # entries in ``messages``
    max_blocks: int = 20_000  # content blocks: system + messages + inside tool results
    max_tools: int = 10_000  # entries in ``tools``


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON, or a 400 saying why not (bad UTF-8, syntax, NaN/Infinity,
    integers past Python's 4,300 digits, nesting past the C parser's stack)."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise invalid(f"request body is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise invalid(
            f"request body is not valid JSON ({exc.msg} at character {exc.pos})"
        ) from None
    except RecursionError:
        raise invalid("request body is not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        raise invalid(f"request body is not valid JSON ({exc})") from None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _blocks(body: dict[str, Any]) -> int:
    n = len(_list(body.get("system")))
    for msg in _list(body.get("messages")):
        content = msg.get("content") if isinstance(msg, dict) else None
        for block in _list(content):
            n += 1
            if isinstance(block, dict):
                n += len(_list(block.get("content")))
    return n


def check_counts(body: Any, limits: BodyLimits) -> None:
    """The caps that cost one pass over the messages, not over every value."""
    if not isinstance(body, dict):
        return  # validation says what is wrong with it
    for field, count, cap in (
        ("messages", len(_list(body.get("messages"))), limits.max_messages),
        ("tools", len(_list(body.get("tools"))), limits.max_tools),
    ):
        if count > cap:
            raise invalid(f"{field}: {count} entries, more than the {cap} allowed")
    blocks = _blocks(body)
    if blocks > limits.max_blocks:
        raise invalid(
            f"messages: {blocks} content blocks in all (system, messages and tool "
            f"results), more than the {limits.max_blocks} allowed"
        )


def _children(value: Any) -> Iterator[tuple[Any, Any]]:
    return iter(value.items()) if isinstance(value, dict) else enumerate(value)


def too_deep(value: Any, max_depth: int) -> str | None:
    """The dotted path of the first object or array nested deeper than ``max_depth``
    (``value`` itself is depth 1), or None. Iterative: no depth can exhaust a stack."""
    if not isinstance(value, dict | list):
        return None
    stack = [_children(value)]
    keys: list[Any] = []  # keys[i] leads from the container at stack[i] to stack[i + 1]
    while stack:
        step = next(stack[-1], None)
        if step is None:
            stack.pop()
            if keys:
                keys.pop()
            continue
        key, child = step
        if isinstance(child, dict | list):
            if len(stack) >= max_depth:
                return ".".join(str(k) for k in [*keys, key])
            keys.append(key)
            stack.append(_children(child))
    return None


def read_body(raw: bytes, model: type[_M], limits: BodyLimits) -> _M:
    """Parse, check and validate ``raw`` as ``model``; every failure is a 400 with
    Anthropic's envelope (a validation error through the app's own handler)."""
    data = parse_json(raw)
    check_counts(data, limits)
    path = too_deep(data, limits.max_depth)
    if path is not None:
        raise invalid(
            f"{path}: nested more than {limits.max_depth} levels deep (objects and "
            "arrays, the body being level 1)"
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
