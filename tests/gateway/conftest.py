from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@contextlib.contextmanager
def postgres_database(prefix: str = "cp_test") -> Iterator[str]:
    """A fresh, empty database on the local PostgreSQL, dropped afterwards; its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """A fresh, empty database: SQLite (embedded default) and PostgreSQL (the cluster's)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/ledger.db"
        return
    with postgres_database() as url:
        yield url


@pytest.fixture
def session(db_url: str) -> Iterator[Session]:
    engine = make_engine(db_url)
    upgrade(engine)
    with make_sessionmaker(engine)() as s:
        yield s
    engine.dispose()


# ------------------------------------------------------------ a live stack


@pytest.fixture(scope="session")
def tiny_engine():
    from cachepoint.engine import Engine, EngineConfig, ModelConfig

    return Engine(ModelConfig.tiny(), EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=4096))


# The contract tests that run, unmodified, on both engines: the official SDK,
# exact buckets across turns, isolation, streaming, usage reports against the ledger.
BOTH_ENGINES = {"test_conformance.py", "test_history_e2e.py"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "stack" in metafunc.fixturenames and Path(metafunc.definition.path).name in BOTH_ENGINES:
        vllm_marks = [pytest.mark.slow, pytest.mark.xdist_group("vllm_replica")]
        engines = ["torch", pytest.param("vllm", marks=vllm_marks)]
        metafunc.parametrize("stack", engines, indirect=True)


@pytest.fixture
def stack(request, seeded_db, serve, tiny_engine):
    """A real replica and a gateway on SQLite, with two orgs' keys. The replica is the
    torch engine's tiny model in process, or (param "vllm") the session's vLLM replica:
    the same model name and byte tokenizer, so the same expected numbers hold."""
    from cachepoint.gateway.app import create_app
    from cachepoint.gateway.settings import GatewaySettings
    from cachepoint.replica.api.app import create_app as create_replica_app
    from cachepoint.replica.settings import ReplicaSettings

    from ..conftest import VLLM_BLOCK

    if getattr(request, "param", "torch") == "vllm":
        replica, block_size = request.getfixturevalue("vllm_replica").url, VLLM_BLOCK
    else:
        replica = serve(create_replica_app(ReplicaSettings(name="r0"), tiny_engine))
        block_size = 16
    db, keys = seeded_db
    settings = GatewaySettings(
        database_url=db,
        replica_urls=[replica],
        min_cacheable_tokens=64,
        max_body_bytes=200_000,
        block_size=block_size,
    )
    url = serve(create_app(settings))
    return {"url": url, "keys": keys, "replica": replica, "db": db}
