"""Byte sizes: the replica's KV sizes and Kubernetes resource quantities.

Two grammars meet in a member pod. The replica reads its KV sizes with binary units
("8GiB", "8Gi", "8G" are all 8 * 2**30); Kubernetes reads memory and storage as
quantities, where "8G" is 8 * 10**9. The operator turns every KV size into a plain
byte count before it reaches either, so the two never disagree about a number.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# NOTE: the replica's own table (cachepoint.replica.settings._UNITS), repeated because
# the operator imports no service code; a test keeps the two equal.
KV_UNITS: dict[str, int] = {"": 1, "b": 1}
for _i, _letter in enumerate("kmgt", start=1):
    for _suffix in (_letter, f"{_letter}b", f"{_letter}ib", f"{_letter}i"):
        KV_UNITS[_suffix] = 2 ** (10 * _i)

KV_SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*([kKmMgGtT]([iI]?[bB]?)|[bB])?\s*$"

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[numkKMGTPE]i?)?$")
_SUFFIX: dict[str, Decimal] = {"": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6")}
_SUFFIX |= {"m": Decimal("1e-3")}
_SUFFIX |= {s: Decimal(1000**i) for i, s in enumerate("kMGTPE", start=1)}
_SUFFIX |= {f"{s}i": Decimal(1024**i) for i, s in enumerate("KMGTPE", start=1)}
_BINARY = [("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)]


def parse_kv_size(value: int | str) -> int:
    """A KV size as the replica reads it: 8Gi, 8GiB, 512MiB, 1073741824 -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r} (try 8Gi or 512Mi)")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in KV_UNITS:
        raise ValueError(f"not a size: {value!r} (try 8Gi or 512Mi)")
    return int(float(m.group(1)) * KV_UNITS[m.group(2).lower()])


def parse_quantity(value: int | str) -> int:
    """A Kubernetes quantity of bytes (64Gi, 64G, 500M, 1e9, 1024) -> bytes, rounded up."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, suffix = m.group(1), m.group(2) or ""
    try:
        amount = Decimal(number)
        if suffix[:1] in ("e", "E"):
            amount *= Decimal(10) ** int(suffix[1:])
        elif suffix in _SUFFIX:
            amount *= _SUFFIX[suffix]
        else:
            raise ValueError(f"not a Kubernetes quantity: {value!r}")
    except InvalidOperation:
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from None
    return int(amount.to_integral_value(rounding="ROUND_CEILING"))


def format_quantity(size: int) -> str:
    """Bytes as the shortest exact binary quantity: 68719476736 -> '64Gi'."""
    for suffix, unit in _BINARY:
        if size and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def add_quantity(value: int | str, extra: int) -> str:
    """A Kubernetes quantity plus `extra` bytes, as a quantity."""
    return format_quantity(parse_quantity(value) + extra)
