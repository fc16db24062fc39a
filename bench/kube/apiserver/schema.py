"""A CRD's structural schema, applied as the API server does on every write.

In order: prune fields the schema does not declare (unless it says
`x-kubernetes-preserve-unknown-fields`), drop nulls that are not `nullable`, fill
`default`s, then validate (OpenAPI value checks and the CEL rules of cel.py). The root's
apiVersion, kind and metadata are the server's own, never pruned.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import attrs

from . import cel
from .errors import FieldError, describe, invalid

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
}
_ROOT_KEYS = ("apiVersion", "kind", "metadata")


def _preserves(schema: dict[str, Any]) -> bool:
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def prune(value: Any, schema: dict[str, Any], root: bool = False) -> Any:
    """`value` less what `schema` does not declare, and less nulls it does not allow."""
    if isinstance(value, list) and "items" in schema:
        return [prune(v, schema["items"]) for v in value]
    if not isinstance(value, dict):
        return value
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    out = {}
    for key, item in value.items():
        if root and key in _ROOT_KEYS:
            out[key] = item
        elif props is not None and key in props:
            sub = props[key]
            if item is None and not sub.get("nullable"):
                continue  # NOTE: the server drops a null it may not store, then defaults it
            out[key] = prune(item, sub)
        elif isinstance(extra, dict):
            out[key] = prune(item, extra)
        elif _preserves(schema) or extra is True:
            out[key] = item
    return out


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, list) and "items" in schema:
        return [apply_defaults(v, schema["items"]) for v in value]
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for key, sub in (schema.get("properties") or {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = apply_defaults(out[key], sub)
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        props = schema.get("properties") or {}
        out.update({k: apply_defaults(v, extra) for k, v in out.items() if k not in props})
    return out


_MISSING = object()


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_error(schema: dict[str, Any], value: Any, path: str) -> FieldError | None:
    if value is None:
        if schema.get("nullable"):
            return None
        return FieldError.invalid(path, value, f"{path} in body must be of type {schema['type']}")
    if schema.get("x-kubernetes-int-or-string"):
        if _TYPES["integer"](value) or isinstance(value, str):
            return None
        return FieldError.invalid(path, value, f"{path} in body must be of type int-or-string")
    wanted = schema.get("type")
    if wanted and not _TYPES[wanted](value):
        got = describe(value).strip('"') if isinstance(value, dict | list) else type_name(value)
        detail = f"{path} in body must be of type {wanted}: {json_type(got)}"
        return FieldError.invalid(path, value, detail)
    return None


def type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string" if isinstance(value, str) else "null"


def json_type(name: str) -> str:
    return f'"{name}"'


def _bounds(schema: dict[str, Any], value: Any, path: str) -> list[FieldError]:
    errors = []
    if isinstance(value, int | float) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and (value <= low if schema.get("exclusiveMinimum") else value < low):
            op = "greater than" if schema.get("exclusiveMinimum") else "greater than or equal to"
            detail = f"{path} in body should be {op} {_num(low)}"
            errors.append(FieldError.invalid(path, value, detail))
        if high is not None and (value >= high if schema.get("exclusiveMaximum") else value > high):
            op = "less than" if schema.get("exclusiveMaximum") else "less than or equal to"
            detail = f"{path} in body should be {op} {_num(high)}"
            errors.append(FieldError.invalid(path, value, detail))
        step = schema.get("multipleOf")
        if step and not math.isclose(value / step, round(value / step)):
            detail = f"{path} in body should be a multiple of {_num(step)}"
            errors.append(FieldError.invalid(path, value, detail))
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            detail = f"{path} in body should be at least {schema['minLength']} chars long"
            errors.append(FieldError.invalid(path, value, detail))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            detail = f"{path} in body should be at most {schema['maxLength']} chars long"
            errors.append(FieldError.invalid(path, value, detail))
        if "pattern" in schema and not re.search(schema["pattern"], value):
            detail = f"{path} in body should match '{schema['pattern']}'"
            errors.append(FieldError.invalid(path, value, detail))
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            detail = f"{path} in body should have at least {schema['minItems']} items"
            errors.append(FieldError.invalid(path, value, detail))
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            detail = f"{path} in body should have at most {schema['maxItems']} items"
            errors.append(FieldError.invalid(path, value, detail))
    if isinstance(value, dict):
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            detail = f"{path} in body should have at least {schema['minProperties']} properties"
            errors.append(FieldError.invalid(path, value, detail))
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            detail = f"{path} in body should have at most {schema['maxProperties']} properties"
            errors.append(FieldError.invalid(path, value, detail))
    if "enum" in schema and value not in schema["enum"]:
        errors.append(FieldError.unsupported(path, value, schema["enum"]))
    return errors


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _list_keys(schema: dict[str, Any], value: list[Any], path: str) -> list[FieldError]:
    """x-kubernetes-list-type: set and map forbid duplicates (of items, of key tuples)."""
    kind = schema.get("x-kubernetes-list-type")
    if kind not in ("set", "map"):
        return []
    keys = schema.get("x-kubernetes-list-map-keys") or []
    seen, errors = [], []
    for i, item in enumerate(value):
        key = item if kind == "set" else [item.get(k) for k in keys if isinstance(item, dict)]
        if key in seen:
            errors.append(FieldError("FieldValueDuplicate", _child(path, i), "Duplicate value"))
        seen.append(key)
    return errors


def validate(
    value: Any, schema: dict[str, Any], path: str = "", old: Any = _MISSING
) -> list[FieldError]:
    """Every field error of `value` (with `old`, its value before an update, for CEL)."""
    error = _type_error(schema, value, path or "<nil>")
    if error is not None:
        return [error]
    if value is None:
        return []
    errors = _bounds(schema, value, path)
    for combinator in ("allOf", "anyOf", "oneOf"):
        branches = schema.get(combinator)
        if not branches:
            continue
        passing = [not validate(value, b, path) for b in branches]
        if combinator == "allOf" and not all(passing):
            errors += [e for b in branches for e in validate(value, b, path)]
        elif combinator == "anyOf" and not any(passing):
            errors.append(FieldError.invalid(path, value, f"{path} in body must match anyOf"))
        elif combinator == "oneOf" and sum(passing) != 1:
            errors.append(FieldError.invalid(path, value, f"{path} in body must match oneOf"))
    if isinstance(value, dict):
        errors += _validate_object(value, schema, path, old)
    elif isinstance(value, list) and "items" in schema:
        errors += _list_keys(schema, value, path)
        for i, item in enumerate(value):
            errors += validate(item, schema["items"], _child(path, i))
    rules = schema.get("x-kubernetes-validations")
    if rules and not errors:
        # NOTE: the server evaluates CEL only where the value already passed the schema.
        has_old = old is not _MISSING
        errors += cel.check(rules, value, path or "<nil>", old if has_old else None, has_old)
    return errors


def _validate_object(
    value: dict[str, Any], schema: dict[str, Any], path: str, old: Any
) -> list[FieldError]:
    errors = [
        FieldError.required(_child(path, key))
        for key in schema.get("required") or ()
        if key not in value
    ]
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    old_map = old if isinstance(old, dict) else {}
    for key, item in value.items():
        sub = props.get(key) if key in props else extra if isinstance(extra, dict) else None
        if sub is None or (not path and key in ("apiVersion", "kind", "metadata")):
            continue
        sub_old = old_map.get(key, _MISSING) if old is not _MISSING else _MISSING
        errors += validate(item, sub, _child(path, key), sub_old)
    return errors


@attrs.frozen
class CustomResource:
    """One served version of a CRD: what a write of it goes through."""

    group: str
    version: str
    plural: str
    kind: str
    schema: dict[str, Any]

    @classmethod
    def from_crd(cls, crd: dict[str, Any]) -> list[CustomResource]:
        spec = crd["spec"]
        out = []
        for version in spec["versions"]:
            schema = (version.get("schema") or {}).get("openAPIV3Schema") or {}
            _compile_all(schema)
            out.append(
                cls(
                    spec["group"],
                    version["name"],
                    spec["names"]["plural"],
                    spec["names"]["kind"],
                    schema,
                )
            )
        return out

    def admit(
        self, obj: dict[str, Any], old: dict[str, Any] | None, cel_rules: bool = True
    ) -> dict[str, Any]:
        """The object as stored: pruned and defaulted; a 422 ApiError when it is invalid.

        `cel_rules=False` is an API server without CEL validation (before 1.25, or with
        the CustomResourceValidationExpressions gate off): only the OpenAPI checks apply.
        """
        stored = apply_defaults(prune(obj, self.schema, root=True), self.schema)
        schema = self.schema if cel_rules else _without_rules(self.schema)
        errors = validate(stored, schema, "", old if old is not None else _MISSING)
        if errors:
            name = obj.get("metadata", {}).get("name") or ""
            raise invalid(self.kind, self.group, name, errors)
        return stored


def _compile_all(schema: Any) -> None:
    """Compile every CEL rule now, as CRD admission does (a bad rule fails the install)."""
    if isinstance(schema, dict):
        cel.compile_rules(schema.get("x-kubernetes-validations") or [])
        for value in schema.values():
            _compile_all(value)
    elif isinstance(schema, list):
        for value in schema:
            _compile_all(value)


def _without_rules(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _without_rules(v) for k, v in schema.items() if k != "x-kubernetes-validations"}
    if isinstance(schema, list):
        return [_without_rules(v) for v in schema]
    return schema
