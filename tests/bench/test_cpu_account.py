"""bench/cpu_account.py: CPU seconds by process group and command, read from /proc (a fake
one with known figures, and the real one for this very process)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from cachepoint.bench import cpu_account as ca


def fake_proc(tmp: Path, procs: dict[int, tuple[str, int, int, int, int, int]]) -> Path:
    """/proc with one stat per pid: (comm, group, utime, stime, cutime, cstime)."""
    for pid, (comm, pgid, ut, st, cut, cst) in procs.items():
        d = tmp / str(pid)
        d.mkdir()
        # fields 3.. after the command: state ppid pgrp session tty tpgid flags minflt
        # cminflt majflt cmajflt utime stime cutime cstime ...
        (d / "stat").write_text(
            f"{pid} ({comm}) S 1 {pgid} 1 0 -1 0 0 0 0 0 {ut} {st} {cut} {cst} 20 0 1 0\n"
        )
    (tmp / "self").mkdir()  # not a pid: skipped
    return tmp


def test_processes_are_summed_by_role_and_command(tmp_path):
    t = ca.TICK
    proc = fake_proc(
        tmp_path,
        {
            10: ("python", 10, 2 * t, t, 0, 0),
            11: ("VLLM::EngineCor", 10, 40 * t, 2 * t, 0, 0),
            12: ("VLLM::EngineCor", 10, 8 * t, 0, t, t),  # its waited-for children count
            20: ("python", 20, t, 0, 0, 0),
            30: ("sshd", 30, 99 * t, 0, 0, 0),  # another group: not ours
            # a command with a space and a ')' in it
            40: ("nats) srv", 40, 3 * t, 0, 0, 0),
        },
    )
    got = ca.sample({"serve": 10, "gateway": 20, "nats": 40}, proc)
    assert got == {
        "serve/python": 3.0,
        "serve/VLLM::EngineCor": 52.0,
        "gateway/python": 1.0,
        "nats/nats) srv": 3.0,
    }


def test_delta_counts_new_processes_from_zero_and_leaves_out_ended_ones():
    before = {"a/x": 1.0, "a/gone": 5.0}
    after = {"a/x": 3.5, "b/new": 0.25}
    assert ca.delta(before, after) == {"a/x": 2.5, "b/new": 0.25}


def test_an_unreadable_or_malformed_stat_is_skipped(tmp_path):
    (tmp_path / "7").mkdir()  # no stat file: the process ended mid-walk
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "stat").write_text("8 (short) S 1\n")
    assert ca.sample({"x": 1}, tmp_path) == {}


def test_the_real_proc_sees_this_process_spend_cpu():
    groups = {"me": os.getpgid(0)}
    before = ca.sample(groups)
    m0 = ca.machine()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    spent = ca.delta(before, ca.sample(groups))
    m1 = ca.machine()
    assert sum(spent.values()) >= 0.25
    busy, total = m1[0] - m0[0], m1[1] - m0[1]
    assert 0.25 <= busy <= total + 1e-6  # both sums of ticks, each rounded on its own
