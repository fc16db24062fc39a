"""Shared fixtures: small engines on the CPU."""

from __future__ import annotations

import pytest

from cachepoint.engine import BlockAllocator, Engine

from .helpers import make_engine


@pytest.fixture(scope="session")
def engine() -> Engine:
    """A tiny float32 engine, block size 16 (shared: tests allocate fresh blocks)."""
    return make_engine(16)


@pytest.fixture(scope="session")
def engine_b4() -> Engine:
    """The same model with 4-token blocks, so short prompts cross many boundaries."""
    return make_engine(4)


@pytest.fixture
def alloc(engine: Engine) -> BlockAllocator:
    return BlockAllocator(engine.num_blocks)
