"""Block copies between KV tiers: validation, and ordering-safe batching.

A copy op names a block in one tier and a block in another: ``(src_tier, src_index,
dst_tier, dst_index)``, tiers ``"device"`` (index = a pool block id), ``"host"`` and
``"disk"`` (index = a slot). Any object with those four attributes is accepted (kvcore's
``BlockCopy``, whose tiers are a ``StrEnum``); the engine never imports kvcore.

A batch runs as if its ops ran one by one, in order: a later op may overwrite the
source of an earlier one (a device block demoted to the host, then promoted into).
:func:`plan_groups` cuts the batch into groups of consecutive ops with the same pair of
tiers in which no op reads or rewrites a block an earlier op of the group wrote; a
group may then be copied all at once (gather every source, then write every
destination) and :func:`runs` merges its consecutive indices into strided copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

TIERS = ("device", "host", "disk")

# (src_tier, src_index, dst_tier, dst_index), tiers as plain strings: what a StepPlan
# carries to TP workers.
Copy = tuple[str, int, str, int]

# Called with the batch position of the next op before each unit of copying starts;
# whatever it raises aborts the batch there (fault injection, like Engine.fault_hook).
CopyHook = Callable[[int], None]


def tier_name(value: object, what: str) -> str:
    """The canonical tier string of ``value`` (a str, a StrEnum, or an enum whose
    ``value`` is one), or ``ValueError``."""
    for name in TIERS:
        # NOTE: ``==`` rather than ``str()``: a ``(str, Enum)`` member compares equal
        # to its value, but its ``str()`` is ``"Tier.DEVICE"`` before Python 3.11's
        # StrEnum.
        if value == name:
            return name
    inner = getattr(value, "value", None)
    if isinstance(inner, str) and inner in TIERS:
        return inner
    raise ValueError(f"{what}: unknown tier {value!r} (expected one of {', '.join(TIERS)})")


def _index(value: object, what: str) -> int:
    # NOTE: not ``operator.index``: the repository's top-level ``operator`` package
    # shadows the stdlib module for type checkers.
    index = getattr(value, "__index__", None)
    if isinstance(value, bool) or index is None:
        raise ValueError(f"{what}: index must be an int, not {value!r}")
    return int(index())


def as_copies(copies: Iterable[object], sizes: Mapping[str, int]) -> list[Copy]:
    """Validate every op and return them as plain tuples, in order.

    ``sizes`` maps each tier this rank has to its number of blocks (slots); a tier
    that is absent or has 0 slots is not configured. Raises ``ValueError`` naming the
    first bad op; nothing has been copied then.
    """
    out: list[Copy] = []
    for i, op in enumerate(copies):
        what = f"copy {i}"
        if isinstance(op, tuple) and len(op) == 4:
            fields: tuple[object, ...] = op
        else:
            try:
                fields = (op.src_tier, op.src_index, op.dst_tier, op.dst_index)  # type: ignore[attr-defined]
            except AttributeError:
                raise ValueError(
                    f"{what}: expected src_tier, src_index, dst_tier and dst_index, got {op!r}"
                ) from None
        src_tier, dst_tier = tier_name(fields[0], what), tier_name(fields[2], what)
        src, dst = _index(fields[1], what), _index(fields[3], what)
        for tier, index, side in ((src_tier, src, "source"), (dst_tier, dst, "destination")):
            size = sizes.get(tier, 0)
            if size <= 0:
                raise ValueError(f"{what}: the engine has no {tier} tier ({side})")
            if not 0 <= index < size:
                raise ValueError(f"{what}: {side} {tier} index {index} outside 0..{size - 1}")
        out.append((src_tier, src, dst_tier, dst))
    return out


@dataclass(slots=True)
class CopyGroup:
    """Consecutive ops with the same tiers that may be copied all at once."""

    src_tier: str  # every op's source tier
    dst_tier: str  # every op's destination tier
    first: int  # batch position of its first op
    src: list[int]  # source indices, in op order
    dst: list[int]  # destination indices, in op order


@dataclass(slots=True, frozen=True)
class Run:
    """Ops of a group whose source and destination indices both count up by one."""

    first: int  # batch position of its first op
    src: int  # first source index
    dst: int  # first destination index
    length: int  # ops (blocks) in the run


def plan_groups(copies: Iterable[Copy]) -> list[CopyGroup]:
    """Cut a batch into groups that keep its one-by-one semantics when each is copied
    as gather-all-then-write-all.

    A group ends where the tiers change, where an op reads a block the group already
    wrote (its source must be the written value), or where it writes one again (the
    later write must win).
    """
    groups: list[CopyGroup] = []
    written: set[tuple[str, int]] = set()
    for pos, (st, s, dt, d) in enumerate(copies):
        g = groups[-1] if groups else None
        hazard = (st, s) in written or (dt, d) in written
        if g is None or hazard or (g.src_tier, g.dst_tier) != (st, dt):
            g = CopyGroup(st, dt, pos, [], [])
            groups.append(g)
            written = set()
        g.src.append(s)
        g.dst.append(d)
        written.add((dt, d))
    return groups


def runs(group: CopyGroup) -> list[Run]:
    """The group's ops merged into runs of consecutive indices.

    NOTE: within one tier a run could overlap itself (blocks 3, 4 into 4, 5), which a
    strided copy does not order; same-tier ops stay runs of one block.
    """
    out: list[Run] = []
    merge = group.src_tier != group.dst_tier
    for k, (s, d) in enumerate(zip(group.src, group.dst, strict=True)):
        last = out[-1] if out else None
        follows = last is not None and (s, d) == (last.src + last.length, last.dst + last.length)
        if merge and last is not None and follows:
            out[-1] = Run(last.first, last.src, last.dst, last.length + 1)
        else:
            out.append(Run(group.first + k, s, d, 1))
    return out
