"""The embedded stack's share-out of the machine's cores."""

from __future__ import annotations

import pytest

from cachepoint.embedded.stack import replica_threads


@pytest.mark.parametrize(
    ("cores", "replicas", "threads"),
    [
        (1, 1, 1),  # never zero
        (2, 1, 1),  # one core held back for the gateway and NATS
        (2, 2, 1),
        (16, 2, 7),
        (16, 1, 15),
        (4, 8, 1),  # more replicas than cores still get a thread each
    ],
)
def test_replica_threads_hold_back_a_core(cores, replicas, threads):
    assert replica_threads(cores, replicas) == threads


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
