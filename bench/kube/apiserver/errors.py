"""Field errors worded as k8s.io/apimachinery's field.Error, and the 422 Invalid they add up to."""

from __future__ import annotations

import json
from typing import Any

import attrs

from .status import ApiError


def describe(value: Any) -> str:
    """A value as field errors print it: strings quoted, objects and lists by their type."""
    if isinstance(value, dict):
        return '"object"'
    if isinstance(value, list):
        return '"array"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return "null" if value is None else str(value)


@attrs.frozen
class FieldError:
    reason: str  # FieldValueInvalid, FieldValueRequired, ...
    field: str
    body: str  # what follows "field: "

    @classmethod
    def invalid(cls, field: str, value: Any, detail: str) -> FieldError:
        return cls("FieldValueInvalid", field, f"Invalid value: {describe(value)}: {detail}")

    @classmethod
    def required(cls, field: str) -> FieldError:
        return cls("FieldValueRequired", field, "Required value")

    @classmethod
    def unsupported(cls, field: str, value: Any, allowed: list[Any]) -> FieldError:
        listed = ", ".join(describe(v) for v in allowed)
        body = f"Unsupported value: {describe(value)}: supported values: {listed}"
        return cls("FieldValueNotSupported", field, body)

    @classmethod
    def from_reason(cls, reason: str | None, field: str, value: Any, message: str) -> FieldError:
        """A CEL rule's failure; `reason` is the rule's, FieldValueInvalid when it has none."""
        if reason == "FieldValueRequired":
            return cls(reason, field, f"Required value: {message}")
        if reason == "FieldValueForbidden":
            return cls(reason, field, f"Forbidden: {message}")
        if reason == "FieldValueDuplicate":
            return cls(reason, field, f"Duplicate value: {describe(value)}: {message}")
        return cls.invalid(field, value, message)

    def __str__(self) -> str:
        return f"{self.field}: {self.body}"


def invalid(kind: str, group: str, name: str, errors: list[FieldError]) -> ApiError:
    """The 422 a create or update gets for these field errors."""
    listed = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(map(str, errors)) + "]"
    qualified = f"{kind}.{group}" if group else kind
    causes = [{"reason": e.reason, "message": e.body, "field": e.field} for e in errors]
    details: dict[str, Any] = {"name": name, "kind": kind, "causes": causes}
    if group:
        details["group"] = group
    return ApiError(422, "Invalid", f'{qualified} "{name}" is invalid: {listed}', details)
