"""CPU seconds by process, from /proc: where a server's cores go during a load.

On a 2-core machine a server's TTFT under concurrency is bounded by the CPU left to
its engine: every CPU second that the gateway, the replica's API process or the
event plane spends while a prefill runs comes out of that prefill. Wall-clock spans
(the serving bench's breakdown) cannot show that; CPU time per process can.

``sample(groups)`` reads every process whose process group is one of ``groups``'
values (each server child leads a group of its own: `vllm serve` under the bench, each
child of `cachepoint up` under the stack) and sums its user and system time, with
its waited-for children's, by "role/command" (the command is the kernel's 15-byte
name, e.g. ``VLLM::EngineCor``). A process that exits between two samples takes its
time with it unless its parent waited for it; a load's processes live through it.
``machine()`` is the whole machine's busy and total CPU seconds (/proc/stat).
"""

from __future__ import annotations

import os
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PROC = Path("/proc")


def _stat(pid_dir: Path) -> tuple[int, str, float] | None:
    """(process group, command, CPU seconds incl. waited-for children) of one process."""
    try:
        raw = (pid_dir / "stat").read_text()
    except OSError:
        return None  # gone, or not ours to read
    # NOTE: the command sits in parentheses and may hold spaces or ')': split at the
    # last ')'; the fields after it start at field 3 (state), man proc(5).
    head, _, tail = raw.rpartition(")")
    comm = head.partition("(")[2]
    rest = tail.split()
    try:
        group = int(rest[2])
        utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
    except (IndexError, ValueError):
        return None
    return group, comm, (utime + stime + cutime + cstime) / TICK


def sample(groups: dict[str, int], proc: Path = PROC) -> dict[str, float]:
    """CPU seconds so far of every process in ``groups`` (role -> process group id),
    by "role/command"."""
    role_of = {pgid: role for role, pgid in groups.items()}
    out: dict[str, float] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        st = _stat(d)
        if st is None or st[0] not in role_of:
            continue
        key = f"{role_of[st[0]]}/{st[1]}"
        out[key] = out.get(key, 0.0) + st[2]
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds spent between two samples, by "role/command" (processes that started
    in between count from zero; ones that ended are left out)."""
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(after.items())}


def machine(proc: Path = PROC) -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat's first
    line: idle and iowait are not busy)."""
    fields = [int(x) for x in (proc / "stat").read_text().splitlines()[0].split()[1:]]
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    idle = fields[3] + fields[4]
    return (total - idle) / TICK, total / TICK
