"""The repository is self-contained: no tracked file reads or links outside it.

A plain clone has no ``shared/`` folder beside it, so a test that reads
``../shared/seed``, a default that points at ``../shared/traces`` or a doc that cites
``../shared/DESIGN.md`` breaks (or misleads) there. The contract is docs/contract.md,
test data is in tests/data/, the simulator's default trace is in its package.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# NOTE: history, not instructions: bench/RESULTS.md and the simulator report record
# the commands that were run (then against ../shared); rewriting them would falsify
# the record. This file names the patterns, so it is left out too.
EXEMPT = re.compile(r"^(bench/RESULTS\.md|bench/sim/.*|tests/test_self_contained\.py)$")

OUTSIDE = re.compile(
    rb"\.\.[/\\]+shared\b"  # ../shared, ..\shared
    rb"|\bshared/(?:DESIGN|seed|traces)\b"  # the folders the repository once read
    rb"|/\s*[\"']shared[\"']|[\"']shared[\"']\s*/"  # pathlib: parent / "shared" / ...
)


def reaches_outside(text: bytes) -> list[str]:
    """The matches in ``text`` that name a path outside the repository."""
    return [m.group().decode(errors="replace") for m in OUTSIDE.finditer(text)]


def tracked(repo: Path) -> list[tuple[str, str]]:
    """(mode, path) of every file tracked in ``repo``, from its index."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-s", "-z"], cwd=repo, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}): nothing is tracked to check")
    rows = []
    for entry in out.split(b"\0"):
        if entry:
            meta, _, path = entry.partition(b"\t")
            rows.append((meta.split()[0].decode(), path.decode()))
    return rows


def offenders(repo: Path) -> list[str]:
    """Each tracked file of ``repo`` that names a path outside it or links outside it."""
    found: list[str] = []
    for mode, path in tracked(repo):
        if EXEMPT.match(path):
            continue
        full = repo / path
        if mode == "120000":  # a symlink: its target must resolve inside the repository
            target = (full.parent / os.readlink(full)).resolve()
            if not target.is_relative_to(repo.resolve()):
                found.append(f"{path}: symlink to {os.readlink(full)}")
            continue
        if mode == "160000" or not full.is_file():  # a submodule, or deleted meanwhile
            continue
        data = full.read_bytes()
        if b"\0" in data[:8192]:  # binary (plots): no path to read
            continue
        found += [f"{path}: {hit}" for hit in reaches_outside(data)]
    return found


@pytest.mark.parametrize(
    "text",
    [
        b"The contract is [`../shared/DESIGN.md`](../shared/DESIGN.md).",
        b'DEFAULT = ("../shared/traces/conversation_trace.jsonl",)',
        b'SEED_DIR = Path(__file__).resolve().parents[3] / "shared" / "seed"',
        b"see shared/DESIGN.md section 6",
        b"copy ..\\shared\\seed first",
    ],
)
def test_the_scan_finds_a_path_outside(text: bytes):
    assert reaches_outside(text)


@pytest.mark.parametrize(
    "text",
    [
        b"a decode batch's shared prefix is one call for all lanes",
        b'TOKEN = "shared-internal-token"',
        b"shared_blocks = table[:shared]",
        b"docs/contract.md \xc2\xa73 and tests/data/seed/",
    ],
)
def test_the_scan_leaves_ordinary_text_alone(text: bytes):
    assert reaches_outside(text) == []


def test_a_link_or_a_read_outside_is_found_in_a_checkout(tmp_path: Path):
    repo = tmp_path / "main"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "a.md").write_text("See ../shared/DESIGN.md.\n")
    (repo / "docs" / "b.md").write_text("Nothing outside.\n")
    (repo / "inside").symlink_to("docs/b.md")
    (repo / "outside").symlink_to("../shared/seed")
    (repo / "absolute").symlink_to("/etc/hostname")
    (repo / "bench" / "sim").mkdir(parents=True)
    (repo / "bench" / "sim" / "summary.md").write_text("ran --trace ../shared/traces/x\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    assert sorted(offenders(repo)) == [
        "absolute: symlink to /etc/hostname",
        "docs/a.md: ../shared",
        "outside: symlink to ../shared/seed",
    ]


def test_no_tracked_file_reads_or_links_outside_the_repository():
    found = offenders(REPO)
    assert not found, "tracked files reach outside the repository:\n" + "\n".join(found)
