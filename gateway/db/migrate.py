"""Bring a database to the latest schema with alembic (idempotent; safe on every start).

Every gateway pod migrates at start. On PostgreSQL the migration runs inside one
transaction that first takes a transaction-level advisory lock, so of several pods
starting together one migrates and the others wait, then find the schema at head and
do nothing. SQLite is the embedded stack's single file: one process, no lock needed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import OperationalError

MIGRATIONS = Path(__file__).parent / "migrations"
# NOTE: advisory lock keys are one bigint namespace per database, shared by every
# application using it: a fixed, distinctive key ("cachepoint" as ASCII, trimmed to fit).
MIGRATION_LOCK_KEY = int.from_bytes(b"cachepnt", "big") & 0x7FFF_FFFF_FFFF_FFFF

log = logging.getLogger("cachepoint.gateway.db")


class DatabaseUnreachable(RuntimeError):
    """The database did not answer within the wait the caller allowed."""


def upgrade(engine: Engine, *, wait_s: float = 0.0) -> None:
    """Migrate to head. ``wait_s`` > 0 first waits up to that long for the database
    to answer (a pod may start before its database does); 0 tries once."""
    if wait_s > 0:
        wait_for_database(engine, wait_s)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            log.info("waiting for the migration lock (advisory lock %d)", MIGRATION_LOCK_KEY)
            # NOTE: a transaction-level lock: released by the commit that makes the new
            # schema visible (or by the rollback of a failed migration), never leaked.
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        before = _revision(conn)
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
        after = _revision(conn)
    if before == after:
        log.info("database schema already at %s", after)
    else:
        log.info("database schema migrated from %s to %s", before or "empty", after)


def _revision(conn: Connection) -> str | None:
    return MigrationContext.configure(conn).get_current_revision()


def wait_for_database(engine: Engine, wait_s: float) -> None:
    """Return once ``SELECT 1`` succeeds; retry with backoff (0.5 s doubling to 5 s)
    until ``wait_s`` have passed, then raise DatabaseUnreachable with the last error."""
    deadline = time.monotonic() + wait_s
    delay, attempt = 0.5, 0
    where = engine.url.render_as_string(hide_password=True)
    while True:
        attempt += 1
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except OperationalError as exc:
            reason = str(exc.orig or exc).strip().splitlines()[0]
            left = deadline - time.monotonic()
            if left <= 0:
                raise DatabaseUnreachable(
                    f"database {where} not reachable after {attempt} attempts in "
                    f"{wait_s:g} s: {reason}"
                ) from exc
            pause = min(delay, left)
            log.warning(
                "database %s not reachable (attempt %d): %s; retrying in %.1f s",
                where,
                attempt,
                reason,
                pause,
            )
            time.sleep(pause)
            delay = min(delay * 2, 5.0)
            continue
        if attempt > 1:
            log.info("database %s reachable after %d attempts", where, attempt)
        return
