"""The embedded stack's state folder, readable by its owner only: the folder and its
subfolders 0700, every file the stack writes there 0600.

The ledger holds stored response bodies and key digests, the logs request lines, and
``secrets.json`` the stack's passwords. The stack's own files are created 0600 here;
its children run under ``PRIVATE_UMASK``, which covers what they create (span files,
SQLite's ``-wal``/``-shm``/``-journal``, which SQLite also gives the database's own
mode); and an older run's folder is tightened at start.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import IO

PRIVATE_UMASK = 0o077  # for the children: no group or other bit on anything they create
# Top-level files of the state folder (and SQLite's companions of the ledger): an older
# run's are tightened. NOTE: names, not everything there: `--state-dir .` must not
# strip the group bits of a whole working tree.
STATE_FILES = ("cachepoint.db", "endpoint.json", "nats.conf", "secrets.json")


def _tighten(path: Path) -> None:
    """Drop the group and other bits of ``path`` (not following a symlink)."""
    with contextlib.suppress(FileNotFoundError):
        st = path.lstat()
        if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)


def prepare(state_dir: Path, subdirs: Iterable[str]) -> None:
    """Make (or tighten) ``state_dir`` 0700 with ``subdirs`` in it, and tighten what an
    older run left there: the stack's top-level files, everything in ``subdirs``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    for entry in state_dir.iterdir():
        if entry.name.startswith(STATE_FILES):  # also cachepoint.db-wal, endpoint.json.tmp
            _tighten(entry)
    for sub in subdirs:
        folder = state_dir / sub
        folder.mkdir(mode=0o700, exist_ok=True)
        _tighten(folder)
        for path in folder.rglob("*"):
            _tighten(path)


def touch(path: Path) -> None:
    """Create ``path`` empty and 0600 unless it exists (then tighten it): SQLite opens
    an existing file with its mode, and gives its journals the same."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & ~0o077)
    finally:
        os.close(fd)


def open_log(path: Path, append: bool) -> IO[bytes]:
    """``path`` opened for writing (appended to or truncated), created 0600; an older,
    readable one is tightened first."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab" if append else "wb")
