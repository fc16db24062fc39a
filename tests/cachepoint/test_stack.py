"""The embedded stack's share-out of the machine's cores."""

from __future__ import annotations

import pytest

from cachepoint.stack import replica_threads


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
