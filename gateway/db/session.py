"""Engine and session factory; SQLite is tuned for a single-writer embedded ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[1] if "///" in url else ""
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            # NOTE: WAL lets reports read while requests bill; synchronous=NORMAL keeps a
            # commit in the hundreds of microseconds, and WAL stays crash-consistent.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    # NOTE: libpq waits forever for a host that drops packets; a bound makes a start
    # that waits for its database (migrate.wait_for_database) retry instead of hang.
    connect_args = {} if "connect_timeout" in url else {"connect_timeout": 10}
    return create_engine(
        url, pool_pre_ping=True, pool_size=10, max_overflow=20, connect_args=connect_args
    )


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
