"""`cachepoint up --engine vllm`: the refusals, the replicas' command line, and a real
stack on vLLM's CPU build (from .venv-vllm) billing a cache write, then a read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from cachepoint.embedded import private
from cachepoint.embedded.stack import (
    KV_HOST_ON_VLLM,
    VLLM_PYTHON_ENV,
    Stack,
    StackError,
    vllm_python,
)
from cachepoint.replica.cli import build_parser

from ..conftest import _free_port

if TYPE_CHECKING:
    import anthropic

CMD = [sys.executable, "-m", "cachepoint.embedded.cli", "up"]
REPO = Path(__file__).resolve().parents[2]


def _up(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CMD, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


def test_up_refuses_vllm_without_its_venv_in_one_line(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    state = tmp_path / "state"
    r = _up("--engine", "vllm", "--state-dir", str(state), env={VLLM_PYTHON_ENV: str(missing)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout == (
        f"cachepoint up: --engine vllm: no vLLM environment at {missing}; run `make vllm`, "
        f"or set {VLLM_PYTHON_ENV} to a python with vllm and cachepoint\n"
    )
    assert r.stderr == ""
    assert not state.exists()  # nothing started: no state folder, no logs, no NATS


def test_a_python_without_vllm_is_refused_before_anything_starts(tmp_path):
    """This venv's own python has cachepoint but not vLLM (the usual mistake)."""
    stack = Stack(tmp_path / "state", engine="vllm", vllm_python=Path(sys.executable))
    with pytest.raises(StackError) as err:
        stack.start()
    assert str(err.value) == (
        f"--engine vllm: {sys.executable} cannot import vllm; run `make vllm`, "
        f"or set {VLLM_PYTHON_ENV} to a python with vllm and cachepoint"
    )
    assert stack.children == []
    assert not (tmp_path / "state").exists()


def test_kv_host_bytes_is_a_usage_error_with_vllm(tmp_path):
    r = _up("--engine", "vllm", "--kv-host-bytes", "1GiB", "--state-dir", str(tmp_path / "s"))
    assert r.returncode == 2
    assert r.stderr.splitlines()[-1] == f"cachepoint: error: {KV_HOST_ON_VLLM}"
    assert "Traceback" not in r.stderr
    with pytest.raises(StackError, match="--kv-host-bytes is not available"):
        Stack(tmp_path / "s", engine="vllm", kv_host_bytes="1GiB").start()
    assert not (tmp_path / "s").exists()


def test_vllm_replicas_run_from_the_vllm_python_with_its_geometry(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    stack = Stack(tmp_path, engine="vllm", vllm_python=python, kv_budget="128MiB")
    stack.nats_url = "nats://127.0.0.1:4222"
    args = stack.replica_args(0, 8101, "http://127.0.0.1:8101")
    # NOTE: the supervisor restarts a child from exactly this command line, so a
    # restarted vLLM replica runs from the same interpreter.
    assert args[0] == str(python)
    assert args[1:3] == ["-m", "cachepoint.replica.cli"]
    parsed = build_parser().parse_args(args[3:])
    assert parsed.engine == "vllm"
    assert parsed.block_size == 32
    assert parsed.model_preset == "small"
    assert parsed.kv_cache_bytes == 128 * 2**20

    torch = Stack(tmp_path)
    torch.nats_url = stack.nats_url
    targs = torch.replica_args(0, 8101, "http://127.0.0.1:8101")
    assert targs[0] == sys.executable
    parsed = build_parser().parse_args(targs[3:])
    assert (parsed.engine, parsed.block_size, parsed.model_preset) == (None, None, "tiny")


def test_the_vllm_python_override_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "py"))
    assert vllm_python() == tmp_path / "py"
    monkeypatch.delenv(VLLM_PYTHON_ENV)
    # This venv has no vLLM: the .venv-vllm beside it (`make vllm`'s).
    assert vllm_python() == Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _group(pgid: int) -> set[int]:
    """Live processes in process group ``pgid``."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.add(int(entry))
    return found


def test_a_restart_kills_what_the_dead_child_left_behind(tmp_path):
    """A vLLM replica killed by SIGKILL leaves its engine core and worker running
    (re-parented, never exiting): the restart ends them first. A stand-in child here:
    a process that leaves a `sleep` behind in its group."""
    stack = Stack(tmp_path / "state", replicas=1)
    private.prepare(stack.state_dir, ("logs",))
    code = "import subprocess, time; print(subprocess.Popen(['sleep', '600']).pid); time.sleep(600)"
    stack._spawn("leaver", [sys.executable, "-c", code], "")
    child = stack.children[0]
    try:
        deadline = time.time() + 20
        while not child.log.read_text().strip():
            assert time.time() < deadline
            time.sleep(0.05)
        leftover = int(child.log.read_text().split()[0])
        first = child.pid
        os.kill(first, signal.SIGKILL)
        child.proc.wait(5)
        assert _alive(leftover)
        stack._respawn(child)
        assert not _alive(leftover)
        assert child.pid != first
    finally:
        stack.stop()
    assert not _alive(child.pid)


# ------------------------------------------------------------------- the real stack

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
# NOTE: about 2,000 words of varied text: some 2,500 SmolLM2 tokens, far past the
# 256-token floor `cachepoint up` sets for a real tokenizer, so the marker is cached.
SYSTEM = " ".join(f"Rule {i}: answer item {i * 7 % 101} before {i * 13 % 97}." for i in range(180))


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, list[str]]]:
    """One vLLM replica behind the gateway, as `cachepoint up --engine vllm --replicas 1`
    starts it (about 35 s on two cores), shared by the tests below; with the progress
    lines it printed."""
    if not VLLM_PYTHON.exists():
        pytest.fail("no .venv-vllm: run `make vllm` (make test does) for the vLLM stack tests")
    messages: list[str] = []
    stack = Stack(
        tmp_path_factory.mktemp("vllm-up") / "state",
        replicas=1,
        port=_free_port(),
        engine="vllm",
        tracing=False,
        min_cacheable_tokens=256,  # `cachepoint up`'s floor for a real tokenizer
    )
    began = time.monotonic()
    stack.start(progress=messages.append)
    print(f"\nthe vLLM stack started in {time.monotonic() - began:.1f}s")
    try:
        yield stack, messages
    finally:
        replicas = [c.pid for c in stack.children if c.name.startswith("replica-")]
        group = {p for pid in replicas for p in _group(pid)}
        began = time.monotonic()
        stack.stop()
        print(f"\nthe vLLM stack stopped in {time.monotonic() - began:.1f}s")
        assert not [p for p in group if _alive(p)], "vLLM processes left behind"


def _ask(stack: Stack) -> anthropic.types.Usage:
    import anthropic

    client = anthropic.Anthropic(
        base_url=stack.base_url, api_key=stack.keys["api_key"], max_retries=0, timeout=120
    )
    msg = client.messages.create(
        model=stack.served_model(),
        max_tokens=4,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": "Which item comes first?"}],
    )
    assert msg.usage.output_tokens >= 1
    return msg.usage


@pytest.mark.slow
def test_up_on_vllm_bills_a_write_then_a_read(vllm_stack):
    stack, messages = vllm_stack
    replica = next(c for c in stack.children if c.name == "replica-0")
    assert replica.args[0] == str(vllm_python())
    assert "starting replica-0 (vLLM" in " ".join(messages), messages
    assert len(_group(replica.pid)) > 1, "vLLM's engine core runs beside the replica"
    first, second = _ask(stack), _ask(stack)
    assert first.cache_creation_input_tokens >= 256, first
    assert (first.cache_read_input_tokens or 0) == 0, first
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens, second
    assert (second.cache_creation_input_tokens or 0) == 0, second


@pytest.mark.slow
def test_a_killed_vllm_replica_comes_back_from_the_same_venv(vllm_stack):
    """kill -9 of a vLLM replica: its engine core is ended, not left holding the model,
    and the replica is started again from .venv-vllm's python and serves."""
    stack, _ = vllm_stack
    replica = next(c for c in stack.children if c.name == "replica-0")
    old, argv = replica.pid, list(replica.args)
    leftovers = _group(old) - {old}
    assert leftovers, "vLLM's engine core runs beside the replica"
    os.kill(old, signal.SIGKILL)
    deadline = time.time() + 180
    while not (replica.pid != old and _ready(replica.url) and _fleet(stack) == 1):
        assert time.time() < deadline, "the replica did not come back"
        time.sleep(0.5)
    assert replica.args == argv and argv[0] == str(vllm_python())
    with open(f"/proc/{replica.pid}/cmdline", "rb") as f:
        assert f.read().split(b"\0")[0].decode() == argv[0]  # the venv's own path
    assert not [p for p in leftovers if _alive(p)], "the killed replica's vLLM processes live on"
    _ask(stack)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _fleet(stack: Stack) -> int:
    try:
        return int(httpx.get(f"{stack.base_url}/readyz", timeout=2).json()["replicas_live"])
    except (httpx.HTTPError, ValueError, KeyError):
        return 0
