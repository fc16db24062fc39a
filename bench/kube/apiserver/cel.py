"""`x-kubernetes-validations` rules, evaluated with cel-python as the API server does with cel-go.

`self` is the value at the schema node that holds the rule, `oldSelf` its value before
an update. A rule that reads `oldSelf` is a transition rule: it is skipped on create
and wherever the old object had no value (unless `optionalOldSelf`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from typing import Any

import celpy

from .errors import FieldError

# NOTE: kopf's --verbose puts the root logger at DEBUG, and celpy then logs every name it
# resolves with the whole object printed: megabytes of captured log per operator test.
logging.getLogger("celpy").setLevel(logging.WARNING)

_OLD_SELF = re.compile(r"\boldSelf\b")
_ENV = celpy.Environment()


class RuleError(ValueError):
    """A rule that does not compile: a real server refuses the CRD that holds it."""


@functools.cache
def _program(expression: str) -> Any:
    try:
        return _ENV.program(_ENV.compile(expression))
    except celpy.CELParseError as e:
        raise RuleError(f"compilation failed for {expression!r}: {e}") from e


def compile_rules(rules: list[dict[str, Any]]) -> None:
    """Fail now, as CRD admission would, for a rule or messageExpression that does not parse."""
    for rule in rules:
        _program(rule["rule"])
        if rule.get("messageExpression"):
            _program(rule["messageExpression"])


def _evaluate(expression: str, activation: dict[str, Any]) -> Any:
    result = _program(expression).evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise result
    return result


def check(
    rules: list[dict[str, Any]], value: Any, path: str, old: Any, has_old: bool
) -> list[FieldError]:
    errors = []
    for rule in rules:
        expression = rule["rule"]
        transition = bool(_OLD_SELF.search(expression))
        if transition and not has_old and not rule.get("optionalOldSelf"):
            continue
        activation = {"self": celpy.json_to_cel(value)}
        if transition:
            activation["oldSelf"] = celpy.json_to_cel(old) if has_old else None
        field = path + (rule.get("fieldPath") or "")
        try:
            ok = bool(_evaluate(expression, activation))
        except celpy.CELEvalError as e:
            message = f"{e.args[0] if e.args else e} evaluating rule: {expression}"
            errors.append(FieldError.invalid(field, value, message))
            continue
        if ok:
            continue
        message = rule.get("message") or f"failed rule: {expression}"
        if rule.get("messageExpression"):
            # NOTE: the server falls back to `message` when the expression fails.
            with contextlib.suppress(celpy.CELEvalError):
                message = str(_evaluate(rule["messageExpression"], activation))
        errors.append(FieldError.from_reason(rule.get("reason"), field, value, message))
    return errors
