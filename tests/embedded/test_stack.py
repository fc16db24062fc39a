"""The embedded stack's share-out of the machine's cores."""

from __future__ import annotations

import pytest

from cachepoint.embedded.stack import replica_threads


@pytest.mark.parametrize(
    ("cores", "replicas", "threads"),
    [
        (1, 1, 1),  # never zero
        (2, 1, 2),  # a lone replica takes every core: prefill is compute-bound
        (2, 2, 1),
        (3, 2, 1),
        (16, 2, 8),
        (16, 1, 16),
        (4, 8, 1),  # more replicas than cores still get a thread each
    ],
)
def test_replica_threads_share_out_the_cores(cores, replicas, threads):
    assert replica_threads(cores, replicas) == threads


class _Proc:
    pid = 0


def _replica_env(stack, monkeypatch) -> dict[str, str]:
    """The environment the stack would start replica-0 with (nothing is started)."""
    from cachepoint.embedded import stack as stack_module

    seen: list[dict[str, str]] = []
    monkeypatch.setattr(
        stack_module, "_popen", lambda args, env, log, append: seen.append(env) or _Proc()
    )
    stack._spawn("replica-0", ["replica"], "http://127.0.0.1:1")
    return seen[0]


def test_replica_threads_reach_the_replica_environment(tmp_path, monkeypatch):
    """--threads wins over the caller's $OMP_NUM_THREADS, which wins over the share-out."""
    import os

    from cachepoint.embedded.stack import Stack

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = _replica_env(Stack(tmp_path, replicas=1), monkeypatch)
    assert env["OMP_NUM_THREADS"] == str(replica_threads(os.cpu_count() or 1, 1))
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert _replica_env(Stack(tmp_path, replicas=1), monkeypatch)["OMP_NUM_THREADS"] == "5"
    env = _replica_env(Stack(tmp_path, replicas=1, threads=3), monkeypatch)
    assert env["OMP_NUM_THREADS"] == "3"


def test_replicas_spin_briefly_unless_told(tmp_path, monkeypatch):
    """Replicas share the cores with the gateway, NATS and clients: a waiting OpenMP
    thread sleeps after a short spin, unless the caller set GOMP_SPINCOUNT."""
    from cachepoint.embedded.stack import REPLICA_SPINCOUNT, Stack

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert _replica_env(Stack(tmp_path), monkeypatch)["GOMP_SPINCOUNT"] == REPLICA_SPINCOUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert _replica_env(Stack(tmp_path), monkeypatch)["GOMP_SPINCOUNT"] == "0"


def test_up_refuses_zero_threads(capsys):
    from cachepoint.embedded.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["up", "--threads", "0"])
    assert exc.value.code == 2
    assert "--threads must be at least 1" in capsys.readouterr().err


def test_kv_sizes_reach_the_replica_command_line(tmp_path):
    """The stack hands its KV sizes to every replica as flags the replica parses into
    its settings (the host tier only when asked for)."""
    from cachepoint.embedded.stack import Stack
    from cachepoint.replica.cli import build_parser

    assert Stack(tmp_path).kv_args() == []
    stack = Stack(tmp_path, kv_budget="4MiB", kv_host_bytes="16MiB")
    assert stack.kv_args() == ["--kv-budget", "4MiB", "--kv-host-bytes", "16MiB"]
    args = build_parser().parse_args(stack.kv_args())
    assert args.kv_cache_bytes == 4 * 2**20
    assert args.kv_host_bytes == 16 * 2**20
