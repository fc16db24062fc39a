"""A default embedded stack, shared by the tests that only look at it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cachepoint.embedded.stack import Stack

from ..conftest import _free_port


@pytest.fixture(scope="session")
def default_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`cachepoint up`'s stack with its defaults (one replica, the random model over
    SmolLM2's tokenizer, NATS auth), started once: each start costs several seconds of
    process imports, and the tests that use it only read it and call it."""
    stack = Stack(tmp_path_factory.mktemp("default") / "state", replicas=1, port=_free_port(),
                  tracing=False)  # fmt: skip
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()
