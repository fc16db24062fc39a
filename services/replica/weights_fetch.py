"""Download a model's weights from the Hugging Face Hub into a directory, once.

The member pod's init container runs it (operator/pod.py) before the replica starts:

    python -m cachepoint.replica.weights_fetch --repo org/model --revision main --dest /models

The token comes from HF_TOKEN (optional: public repositories need none) and the Hub
from HF_ENDPOINT (a mirror; default huggingface.co). It is idempotent: a completion
marker in --dest records the repository, revision and commit, and a later run for the
same ones does nothing (a restarted pod, or a member on a claim another one filled). An
interrupted run leaves its partial file and the list of finished ones; the next run
resumes there (HTTP ranges). Progress goes to the log; a failure is one line saying what
to fix, with an exit code per cause.

NOTE: huggingface_hub lists the files and builds the URLs and auth headers, but the
files are fetched here: its own downloads resume only within one process (a partial
file is deleted when the process fails), and a pod's restart must not start a 16 GB
file over.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers

log = logging.getLogger("cachepoint.weights_fetch")

MARKER = ".cachepoint-weights.json"
# Under --dest: one folder per commit with the partial file and the finished list.
WORK_DIR = ".cachepoint-download"
_DONE = "done.json"
_CHUNK = 1 << 20

EXIT_FAILED = 1  # anything else (network, the Hub's 5xx): the kubelet retries
EXIT_USAGE = 2
EXIT_ACCESS = 3  # 401 / 403: the token, or access to a gated repository
EXIT_NOT_FOUND = 4  # no such repository, revision or file
EXIT_NO_SPACE = 5  # the volume is too small


class FetchError(Exception):
    """A failed download, with the message an operator acts on and an exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int


@dataclass(frozen=True)
class Snapshot:
    commit: str
    files: tuple[RemoteFile, ...]

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)


def read_marker(dest: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(dest: Path, repo: str, revision: str) -> bool:
    marker = read_marker(dest)
    return marker is not None and (marker.get("repo"), marker.get("revision")) == (repo, revision)


def _write_marker(dest: Path, repo: str, revision: str, snapshot: Snapshot) -> None:
    record = {
        "repo": repo,
        "revision": revision,
        "commit": snapshot.commit,
        "files": [f.name for f in snapshot.files],
        "bytes": snapshot.total,
    }
    tmp = dest / (MARKER + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    # NOTE: a rename, so that a marker is either absent or whole: a pod killed while
    # writing it must not leave one that says "complete".
    tmp.replace(dest / MARKER)


def list_snapshot(api: HfApi, repo: str, revision: str, token: str | None) -> Snapshot:
    # token False: no token at all, not one saved on this machine.
    info = api.model_info(repo, revision=revision, files_metadata=True, token=token or False)
    if not info.sha:
        raise FetchError(f"the Hub gave no commit for {repo}@{revision}")
    files = tuple(
        RemoteFile(name=s.rfilename, size=int(s.size or 0)) for s in (info.siblings or [])
    )
    if not files:
        raise FetchError(f"{repo}@{revision} has no files", EXIT_NOT_FOUND)
    return Snapshot(commit=info.sha, files=files)


class _Work:
    """The resumable state of one commit's download: which files are finished, and the
    partial file of the one in progress."""

    def __init__(self, dest: Path, commit: str) -> None:
        root = dest / WORK_DIR
        # Another commit's leftovers would only take space: this one replaces them.
        if root.is_dir():
            for old in root.iterdir():
                if old.name != commit:
                    shutil.rmtree(old, ignore_errors=True)
        self.dir = root / commit
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.done: set[str] = set(json.loads((self.dir / _DONE).read_text()))
        except (OSError, ValueError):
            self.done = set()

    def part(self, file: RemoteFile) -> Path:
        return self.dir / (hashlib.sha256(file.name.encode()).hexdigest()[:24] + ".part")

    def partial_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("*.part"))

    def finish(self, file: RemoteFile) -> None:
        self.done.add(file.name)
        tmp = self.dir / (_DONE + ".tmp")
        tmp.write_text(json.dumps(sorted(self.done)))
        tmp.replace(self.dir / _DONE)


def check_space(dest: Path, snapshot: Snapshot, work: _Work) -> None:
    """Fail before downloading anything when the volume cannot hold what is missing."""
    missing = sum(f.size for f in snapshot.files if f.name not in work.done)
    missing -= min(missing, work.partial_bytes())
    free = shutil.disk_usage(dest).free
    if missing > free:
        raise FetchError(
            f"disk full: {dest} has {_gib(free)} free, the download needs {_gib(missing)} "
            "more: give the weights storage a larger size",
            EXIT_NO_SPACE,
        )


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


class _Progress:
    """Logs bytes in place every `interval` seconds while files download."""

    def __init__(self, work: _Work, snapshot: Snapshot, interval: float) -> None:
        self.work, self.snapshot, self.interval = work, snapshot, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def __enter__(self) -> _Progress:
        if self.interval > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def report(self) -> None:
        total = self.snapshot.total
        done = sum(f.size for f in self.snapshot.files if f.name in self.work.done)
        have = min(total, done + self.work.partial_bytes())
        share = 100 * have / total if total else 100.0
        log.info("progress: %s of %s (%.1f%%)", _gib(have), _gib(total), share)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            # NOTE: a partial file may be renamed under us; the next tick reads again.
            with contextlib.suppress(OSError):
                self.report()


def _download(client: httpx.Client, url: str, file: RemoteFile, part: Path, dest: Path) -> None:
    """One file into `part`, from where an earlier attempt stopped, then into place."""
    have = part.stat().st_size if part.exists() else 0
    if have > file.size:  # not ours to trust: start over
        part.unlink()
        have = 0
    headers = {"Range": f"bytes={have}-"} if 0 < have < file.size else {}
    if have < file.size or file.size == 0:
        with client.stream("GET", url, headers=headers) as response:
            if response.status_code >= 400:
                response.read()
                raise _HttpError(response.status_code, url)
            # A server that ignores the range sends it all: start the file over.
            mode = "ab" if response.status_code == 206 else "wb"
            with part.open(mode) as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
    size = part.stat().st_size
    if size != file.size:
        raise FetchError(f"{file.name}: got {size} bytes, the Hub lists {file.size}")
    target = dest / file.name
    target.parent.mkdir(parents=True, exist_ok=True)
    part.replace(target)


class _HttpError(Exception):
    def __init__(self, status: int, url: str) -> None:
        super().__init__(f"HTTP {status} for {url}")
        self.status = status


def fetch(
    *,
    repo: str,
    revision: str,
    dest: Path,
    token: str | None = None,
    endpoint: str | None = None,
    progress_interval: float = 30.0,
    attempts: int = 3,
    retry_delay: float = 5.0,
) -> bool:
    """Download `repo`@`revision` into `dest` unless it is there; True if it downloaded.

    A dropped connection is retried `attempts` times in this run (each resuming); what
    is left after that, the next run (the init container's restart) resumes.
    """
    if is_complete(dest, repo, revision):
        log.info("%s@%s is already in %s: nothing to do", repo, revision, dest)
        return False
    if not dest.is_dir() or not os.access(dest, os.W_OK):
        raise FetchError(
            f"{dest} is not a writable directory: mount the weights volume there "
            "(the pod's fsGroup makes a fresh volume writable)",
            EXIT_USAGE,
        )
    # A marker for another repository or revision: this one replaces what it describes.
    (dest / MARKER).unlink(missing_ok=True)
    try:
        snapshot = list_snapshot(HfApi(endpoint=endpoint), repo, revision, token)
        log.info(
            "%s@%s is commit %s: %d files, %s, into %s",
            repo,
            revision,
            snapshot.commit,
            len(snapshot.files),
            _gib(snapshot.total),
            dest,
        )
        work = _Work(dest, snapshot.commit)
        check_space(dest, snapshot, work)
        headers = build_hf_headers(token=token or False)
        # NOTE: the Hub redirects large files to its CDN; httpx drops Authorization when a
        # redirect leaves the origin, so the token goes to the Hub alone.
        with (
            httpx.Client(headers=headers, follow_redirects=True, timeout=60.0) as client,
            _Progress(work, snapshot, progress_interval) as progress,
        ):
            for i, file in enumerate(snapshot.files, start=1):
                if file.name in work.done and (dest / file.name).exists():
                    continue
                # NOTE: the commit, not the revision: a branch that moves meanwhile must
                # not mix files of two commits.
                url = hf_hub_url(repo, file.name, revision=snapshot.commit, endpoint=endpoint)
                for attempt in range(1, attempts + 1):
                    try:
                        _download(client, url, file, work.part(file), dest)
                        break
                    except httpx.TransportError as e:
                        if attempt == attempts:
                            raise
                        log.warning("%s: %s; resuming (attempt %d)", file.name, e, attempt + 1)
                        time.sleep(retry_delay)
                work.finish(file)
                log.info("[%d/%d] %s (%s)", i, len(snapshot.files), file.name, _gib(file.size))
            progress.report()
    except FetchError:
        raise
    except Exception as e:
        raise explain(e, repo=repo, revision=revision, token=token) from e
    _write_marker(dest, repo, revision, snapshot)
    shutil.rmtree(dest / WORK_DIR, ignore_errors=True)
    log.info("%s@%s is complete in %s", repo, revision, dest)
    return True


def explain(e: Exception, *, repo: str, revision: str, token: str | None) -> FetchError:
    """One actionable line for what went wrong."""
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, GatedRepoError):
        return FetchError(
            f"{repo} is gated: accept its terms on the Hub with the account whose token is "
            "in tokenSecret",
            EXIT_ACCESS,
        )
    if isinstance(e, RevisionNotFoundError):
        return FetchError(f"{repo} has no revision {revision!r} (404)", EXIT_NOT_FOUND)
    if isinstance(e, RepositoryNotFoundError):
        if status == 401:
            who = "the token in HF_TOKEN has no access to it" if token else "no token was given"
            return FetchError(
                f"the Hub refused {repo} (401): it is private, gated or missing, and {who}: "
                "check model.huggingFace.repo and tokenSecret",
                EXIT_ACCESS,
            )
        return FetchError(f"no repository {repo} on the Hub ({status or 404})", EXIT_NOT_FOUND)
    if isinstance(e, _HttpError):
        status = e.status
    if isinstance(e, HfHubHTTPError | _HttpError) and status in (401, 403):
        return FetchError(
            f"the Hub refused the token ({status}): check the Secret in tokenSecret",
            EXIT_ACCESS,
        )
    if isinstance(e, HfHubHTTPError | _HttpError) and status == 404:
        return FetchError(f"{repo}@{revision}: not found (404): {e}", EXIT_NOT_FOUND)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return FetchError(
            "disk full while downloading: give the weights storage a larger size",
            EXIT_NO_SPACE,
        )
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return FetchError(f"download of {repo}@{revision} failed: {type(e).__name__}: {first}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cachepoint.replica.weights_fetch",
        description="Download a Hugging Face model into a directory, once (token: HF_TOKEN).",
    )
    parser.add_argument("--repo", required=True, help="repository id, e.g. org/model")
    parser.add_argument("--revision", default="main", help="branch, tag or commit")
    parser.add_argument("--dest", required=True, type=Path, help="directory to fill")
    parser.add_argument(
        "--progress-interval", type=float, default=30.0, help="seconds between progress lines"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout
    )
    try:
        fetch(
            repo=args.repo,
            revision=args.revision,
            dest=args.dest,
            token=os.environ.get("HF_TOKEN") or None,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            progress_interval=args.progress_interval,
        )
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
