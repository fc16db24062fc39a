"""The gateway ledger's usage rows, for benches that audit what the clients were told
(``from cachepoint.bench.usage_ledger import usage_rows``)."""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Any


def usage_rows(db_url: str) -> list[dict[str, Any]]:
    """Every row of the embedded stack's SQLite ``usage`` table, by bucket name."""
    path = db_url.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.row_factory = sqlite3.Row
        rows = db.execute(
            "SELECT request_id, replica, input_tokens, cache_read_input_tokens, "
            "cache_write_5m_tokens, cache_write_1h_tokens, output_tokens FROM usage"
        ).fetchall()
    return [
        {
            "request_id": r["request_id"],
            "replica": r["replica"],
            "input": r["input_tokens"],
            "cache_read": r["cache_read_input_tokens"],
            "cache_write_5m": r["cache_write_5m_tokens"],
            "cache_write_1h": r["cache_write_1h_tokens"],
            "output": r["output_tokens"],
        }
        for r in rows
    ]
