"""The Hugging Face download step, against a local server that imitates the Hub.

The server answers what huggingface_hub asks: the model info with file sizes
(/api/models/<repo>/revision/<rev>), then HEAD and GET with ranges on
/<repo>/resolve/<rev>/<file>, with the Hub's auth errors (401 + X-Error-Code).
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from cachepoint.replica import weights_fetch
from cachepoint.replica.weights_fetch import (
    EXIT_ACCESS,
    EXIT_NO_SPACE,
    EXIT_NOT_FOUND,
    MARKER,
    FetchError,
    fetch,
    main,
)

COMMIT = "a" * 40
TOKEN = "hf_good_token"
WEIGHTS = bytes(range(256)) * 4096  # 1 MiB, more than one download chunk


@dataclass
class Repo:
    files: dict[str, bytes]
    private: bool = False


@dataclass
class FakeHub:
    repos: dict[str, Repo]
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    # A file whose GET sends only this many bytes, then drops the connection; while
    # `broken`, any later GET of it gets a 503 (so huggingface_hub's own retry fails).
    cut_file: str | None = None
    cut_after: int = 0
    broken: bool = False
    url: str = ""


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _fail(self, status: int, code: str | None = None, message: str = "") -> None:
            body = json.dumps({"error": message or code or "error"}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            if message:
                self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _authorized(self, repo: Repo | None) -> bool:
            auth = self.headers.get("Authorization")
            if auth is not None and auth != f"Bearer {TOKEN}":
                self._fail(401, message="Invalid credentials in Authorization header")
                return False
            if repo is None or (repo.private and auth is None):
                # NOTE: the Hub answers 401 RepoNotFound for private and missing repos alike
                # when unauthenticated, 404 when authenticated.
                status = 401 if auth is None else 404
                self._fail(status, "RepoNotFound", "Repository not found")
                return False
            return True

        def do_GET(self) -> None:
            self._serve()

        def do_HEAD(self) -> None:
            self._serve()

        def _serve(self) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            if path.startswith("/api/models/"):
                repo_id, _, revision = path.removeprefix("/api/models/").partition("/revision/")
                repo = hub.repos.get(repo_id)
                if not self._authorized(repo):
                    return
                assert repo is not None
                if revision not in ("main", COMMIT):
                    self._fail(404, "RevisionNotFound", "Invalid rev id")
                    return
                siblings = [{"rfilename": n, "size": len(b)} for n, b in repo.files.items()]
                body = json.dumps({"id": repo_id, "sha": COMMIT, "siblings": siblings}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            repo_id, _, rest = path.lstrip("/").partition("/resolve/")
            revision, _, name = rest.partition("/")
            repo = hub.repos.get(repo_id)
            if not self._authorized(repo):
                return
            assert repo is not None
            if name not in repo.files:
                self._fail(404, "EntryNotFound", "Entry not found")
                return
            self._send_file(name, repo.files[name])

        def _send_file(self, name: str, data: bytes) -> None:
            etag = '"' + hashlib.sha256(data).hexdigest() + '"'
            start = 0
            ranged = self.headers.get("Range")
            if ranged and self.command == "GET":
                start = int(ranged.removeprefix("bytes=").split("-")[0])
            if self.command == "GET" and name == hub.cut_file and hub.broken and start > 0:
                self._fail(503, message="try later")
                return
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", etag)
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            if name == hub.cut_file and hub.broken:
                self.wfile.write(data[: hub.cut_after])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

    return Handler


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    fake = FakeHub(
        repos={
            "org/tiny": Repo(
                files={
                    "config.json": b'{"model_type": "llama"}',
                    "model.safetensors": WEIGHTS,
                    "tokenizer/tokenizer.json": b"{}",
                }
            ),
            "org/private": Repo(files={"config.json": b"{}"}, private=True),
        }
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def downloads(hub: FakeHub) -> list[tuple[str, str, str | None]]:
    return [r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]


def test_downloads_every_file_once_then_does_nothing(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "models"
    dest.mkdir()
    assert main(["--repo", "org/tiny", "--dest", str(dest), "--progress-interval", "0"]) == 0
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    assert (dest / "tokenizer/tokenizer.json").read_bytes() == b"{}"
    marker = json.loads((dest / MARKER).read_text())
    assert marker["repo"] == "org/tiny"
    assert marker["revision"] == "main"
    assert marker["commit"] == COMMIT
    assert marker["bytes"] == len(WEIGHTS) + len(b'{"model_type": "llama"}') + 2
    # Files were asked for at the commit, not the branch (no mix if it moves).
    assert {p.split("/resolve/")[1].split("/")[0] for _, p, _ in downloads(hub)} == {COMMIT}

    hub.requests.clear()
    assert main(["--repo", "org/tiny", "--dest", str(dest)]) == 0
    assert hub.requests == []  # the marker: not even a metadata call


def test_a_new_revision_downloads_again(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "models"
    dest.mkdir()
    assert fetch(repo="org/tiny", revision="main", dest=dest, endpoint=hub.url) is True
    assert fetch(repo="org/tiny", revision="main", dest=dest, endpoint=hub.url) is False
    assert fetch(repo="org/tiny", revision=COMMIT, dest=dest, endpoint=hub.url) is True
    assert json.loads((dest / MARKER).read_text())["revision"] == COMMIT


def test_an_interrupted_download_resumes_where_it_stopped(hub: FakeHub, tmp_path: Path) -> None:
    dest = tmp_path / "models"
    dest.mkdir()
    hub.cut_file, hub.cut_after, hub.broken = "model.safetensors", 300_000, True
    with pytest.raises(FetchError, match="download of org/tiny@main failed"):
        fetch(repo="org/tiny", revision="main", dest=dest, endpoint=hub.url, retry_delay=0)
    assert not (dest / MARKER).exists()  # never "complete" after a failure
    assert not (dest / "model.safetensors").exists()
    (partial,) = (dest / weights_fetch.WORK_DIR).rglob("*.part")
    cut = partial.stat().st_size
    assert 0 < cut < len(WEIGHTS)
    # Within the run, the retry after the dropped connection already asked for the rest.
    assert [r for _, _, r in downloads(hub)][-1] == f"bytes={cut}-"

    hub.broken = False
    hub.requests.clear()
    assert fetch(repo="org/tiny", revision="main", dest=dest, endpoint=hub.url) is True
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    ranges = [r for _, p, r in downloads(hub) if p.endswith("model.safetensors")]
    assert ranges == [f"bytes={cut}-"]  # only the missing part came over again
    # The files that were whole were not fetched again.
    assert not [p for _, p, _ in downloads(hub) if p.endswith("config.json")]


def test_401_without_a_token_says_what_to_fix(
    hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "models"
    dest.mkdir()
    assert main(["--repo", "org/private", "--dest", str(dest)]) == EXIT_ACCESS
    err = capsys.readouterr().err
    assert err.startswith("error: the Hub refused org/private (401)")
    assert "no token was given" in err
    assert "tokenSecret" in err
    assert "Traceback" not in err


def test_a_token_grants_access_and_a_bad_one_is_named(
    hub: FakeHub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dest = tmp_path / "models"
    dest.mkdir()
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert main(["--repo", "org/private", "--dest", str(dest)]) == EXIT_ACCESS
    assert "refused the token (401)" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert main(["--repo", "org/private", "--dest", str(dest)]) == 0
    assert (dest / "config.json").read_bytes() == b"{}"


@pytest.mark.parametrize(
    ("repo", "revision", "message"),
    [("org/missing", "main", "no repository org/missing"), ("org/tiny", "v9", "no revision")],
)
def test_404s_are_named(
    hub: FakeHub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    repo: str,
    revision: str,
    message: str,
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # authenticated, the Hub says 404
    args = ["--repo", repo, "--revision", revision, "--dest", str(tmp_path)]
    assert main(args) == EXIT_NOT_FOUND
    assert message in capsys.readouterr().err


def test_a_volume_too_small_fails_before_downloading(
    hub: FakeHub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    class Usage:
        free = 1000

    monkeypatch.setattr(weights_fetch.shutil, "disk_usage", lambda _: Usage())
    assert main(["--repo", "org/tiny", "--dest", str(tmp_path)]) == EXIT_NO_SPACE
    assert "disk full" in capsys.readouterr().err
    assert downloads(hub) == []


def test_disk_full_while_writing_is_named() -> None:
    error = weights_fetch.explain(
        OSError(28, "No space left on device"), repo="r", revision="main", token=None
    )
    assert (error.code, "disk full" in str(error)) == (EXIT_NO_SPACE, True)


def test_progress_is_logged(hub: FakeHub, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cachepoint.weights_fetch")
    fetch(repo="org/tiny", revision="main", dest=tmp_path, endpoint=hub.url, progress_interval=0)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("[2/3] model.safetensors") for line in lines)
    assert lines[-2].startswith("progress: ") and lines[-2].endswith("(100.0%)")


def test_runs_as_a_module_with_a_clear_error(hub: FakeHub, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachepoint.replica.weights_fetch",
            *("--repo", "org/private", "--dest", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == EXIT_ACCESS, result.stderr
    assert result.stderr.startswith("error: the Hub refused org/private (401)")
