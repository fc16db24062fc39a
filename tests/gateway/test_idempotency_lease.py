"""Idempotency leases, on SQLite and PostgreSQL.

A key in flight is held by a lease its gateway renews; a gateway that dies stops
renewing, and a retry takes the key over once the lease lapsed, billing the cut
attempt from the charge its stream recorded (once, by its request id), instead of
waiting an hour and getting a 409. Two gateways (two engines, two threads) racing for
one lapsed key: exactly one wins. The end-to-end crash (kill -9 of a real gateway
process) is tests/embedded/test_crash_idempotency.py.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, select, text, update

from cachepoint.billing import Buckets, Price
from cachepoint.gateway.billing.ledger import (
    Attribution,
    Charge,
    charge_from_json,
    charge_to_json,
    record_on,
)
from cachepoint.gateway.db.migrate import MIGRATIONS, upgrade
from cachepoint.gateway.db.models import IdempotencyRecord, UsageRecord
from cachepoint.gateway.db.session import make_engine
from cachepoint.gateway.errors import ApiError
from cachepoint.gateway.tenancy import idempotency
from cachepoint.gateway.tenancy.tenants import KeyContext, ScopePolicy

CTX = KeyContext("key-1", "org-1", None, False, ScopePolicy())
DIGEST = "d" * 64
PRICE = Price(input_per_mtok=3_000_000, output_per_mtok=15_000_000)
_T = IdempotencyRecord
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    eng = make_engine(db_url)
    upgrade(eng)
    yield eng
    eng.dispose()


def _charge(rid: str, output: int = 3) -> Charge:
    who = Attribution(session_id="s-1", user_id='{"u":1}', requested_model="claude-x")
    return Charge(
        rid, "org-1", None, "key-1", "m", "replica-0", "org", Buckets(10, 4, 2, 0, output), who
    )


def _row(engine: Engine, key: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(_T.__table__).where(_T.key == key)).mappings().one_or_none()


def _set(engine: Engine, key: str, **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(update(_T).where(_T.key == key).values(**values))


def _usage(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(UsageRecord.request_id, UsageRecord.output_tokens)))


def _ledger(engine: Engine) -> Any:
    """A bill_cut that writes the real ledger row (idempotent by request id) and
    remembers every call."""
    calls: list[Charge] = []

    def bill(charge: Charge) -> bool:
        calls.append(charge)
        return record_on(engine, charge, PRICE)

    bill.calls = calls  # type: ignore[attr-defined]
    return bill


def _die(engine: Engine, key: str, progress: Charge | None) -> None:
    """What a gateway killed mid-stream leaves: its row in flight, the progress it last
    recorded, and a lease that lapsed (it stopped renewing)."""
    values: dict[str, Any] = {"lease_until_s": int(time.time()) - 2}
    if progress is not None:
        values["progress"] = charge_to_json(progress)
    _set(engine, key, **values)


# ------------------------------------------------------------------ the claim row


def test_a_lapsed_claim_is_taken_over_and_its_cut_attempt_billed_once(engine):
    first = idempotency._try(engine, CTX, "k", DIGEST, "req_a", 15.0)
    assert isinstance(first, idempotency.Claim)
    row = _row(engine, "k")
    assert row["status"] is None and row["progress"] is None
    assert time.time() + 14 <= row["lease_until_s"] <= time.time() + 16

    # While the lease holds, a retry waits (in flight), and bills nothing.
    bill = _ledger(engine)
    assert isinstance(
        idempotency._try(engine, CTX, "k", DIGEST, "req_b", 15.0, bill), idempotency._InFlight
    )
    assert bill.calls == []

    _die(engine, "k", _charge("req_a", output=7))
    taken = idempotency._try(engine, CTX, "k", DIGEST, "req_b", 15.0, bill)
    assert isinstance(taken, idempotency.Claim)
    assert taken.request_id == "req_b"
    assert taken.cut == _charge("req_a", output=7)
    assert bill.calls == [_charge("req_a", output=7)]
    assert _usage(engine) == [("req_a", 7)]  # the cut attempt: what it recorded delivering
    row = _row(engine, "k")
    assert (row["request_id"], row["status"], row["progress"]) == ("req_b", None, None)
    assert row["lease_until_s"] >= time.time() + 14

    # The dead owner's late writes change nothing: the row is no longer its own.
    first._complete(200, {}, b"stale", "json")
    first._release()
    assert _row(engine, "k")["request_id"] == "req_b"
    assert _row(engine, "k")["status"] is None
    taken._complete(200, {"h": "v"}, b"fresh", "json")
    replay = idempotency._try(engine, CTX, "k", DIGEST, "req_c", 15.0, bill)
    assert isinstance(replay, idempotency.Recorded)
    assert (replay.body, replay.request_id) == (b"fresh", "req_b")
    assert len(bill.calls) == 1 and _usage(engine) == [("req_a", 7)]


def test_a_takeover_after_the_owner_billed_in_full_bills_nothing_more(engine):
    # The owner wrote its final charge, then died before recording the stream: the
    # retry's bill of the recorded progress (same request id) is a no-op.
    idempotency._try(engine, CTX, "k", DIGEST, "req_a", 15.0)
    assert record_on(engine, _charge("req_a", output=50), PRICE)
    _die(engine, "k", _charge("req_a", output=40))
    bill = _ledger(engine)
    taken = idempotency._try(engine, CTX, "k", DIGEST, "req_b", 15.0, bill)
    assert isinstance(taken, idempotency.Claim)
    assert _usage(engine) == [("req_a", 50)]


def test_a_lapsed_claim_without_progress_is_taken_over_unbilled(engine):
    # A JSON call (or a stream before its prefill) records no progress: the client
    # received nothing, and nothing is billed for it.
    idempotency._try(engine, CTX, "k", DIGEST, "req_a", 15.0)
    _die(engine, "k", None)
    bill = _ledger(engine)
    taken = idempotency._try(engine, CTX, "k", DIGEST, "req_b", 15.0, bill)
    assert isinstance(taken, idempotency.Claim) and taken.cut is None
    assert bill.calls == [] and _usage(engine) == []


def test_a_lapsed_claim_with_another_body_is_still_a_400(engine):
    idempotency._try(engine, CTX, "k", DIGEST, "req_a", 15.0)
    _die(engine, "k", _charge("req_a"))
    bill = _ledger(engine)
    with pytest.raises(ApiError) as info:
        idempotency._try(engine, CTX, "k", "e" * 64, "req_b", 15.0, bill)
    assert info.value.status == 400 and "different request body" in info.value.message
    assert bill.calls == [] and _row(engine, "k")["request_id"] == "req_a"


def test_progress_that_is_not_the_owners_charge_is_not_billed(engine):
    idempotency._try(engine, CTX, "k", DIGEST, "req_a", 15.0)
    _die(engine, "k", _charge("req_someone_else"))
    bill = _ledger(engine)
    assert isinstance(
        idempotency._try(engine, CTX, "k", DIGEST, "req_b", 15.0, bill), idempotency.Claim
    )
    idempotency._try(engine, CTX, "k2", DIGEST, "req_c", 15.0)
    _die(engine, "k2", None)
    _set(engine, "k2", progress='{"buckets": "garbage"}')
    assert isinstance(
        idempotency._try(engine, CTX, "k2", DIGEST, "req_d", 15.0, bill), idempotency.Claim
    )
    assert bill.calls == [] and _usage(engine) == []


def test_rows_without_a_lease_lapse_after_the_legacy_hour(engine):
    # Rows from a gateway without leases (before migration 0005, in a rolling upgrade).
    now = int(time.time())
    for key, age in (("young", 60), ("old", 3600 + 5)):
        idempotency._try(engine, CTX, key, DIGEST, f"req_{key}", 15.0)
        _set(engine, key, lease_until_s=None, created_s=now - age)
    assert isinstance(
        idempotency._try(engine, CTX, "young", DIGEST, "req_x", 15.0), idempotency._InFlight
    )
    assert isinstance(
        idempotency._try(engine, CTX, "old", DIGEST, "req_y", 15.0), idempotency.Claim
    )


# ------------------------------------------------------ two gateways, one lapsed key


@pytest.mark.parametrize("rounds", [12])
def test_two_gateways_racing_for_a_lapsed_key_one_wins(db_url, engine, rounds):
    # Two gateways: two engines (two connection pools), a thread each, released
    # together at the same lapsed key. Exactly one takes it over; the cut attempt is
    # billed once; the loser waits (in flight), and then gets the winner's outcome.
    engines = [make_engine(db_url), make_engine(db_url)]
    bills = [_ledger(e) for e in engines]
    try:
        for n in range(rounds):
            key = f"race-{n}"
            idempotency._try(engine, CTX, key, DIGEST, f"req_dead_{n}", 15.0)
            _die(engine, key, _charge(f"req_dead_{n}", output=n + 1))
            barrier = threading.Barrier(2)

            def race(
                i: int, key: str = key, n: int = n, barrier: threading.Barrier = barrier
            ) -> Any:
                barrier.wait()
                return idempotency._try(
                    engines[i], CTX, key, DIGEST, f"req_gw{i}_{n}", 15.0, bills[i]
                )

            with ThreadPoolExecutor(2) as pool:
                got = list(pool.map(race, range(2)))
            winners = [g for g in got if isinstance(g, idempotency.Claim)]
            assert len(winners) == 1, got
            assert sum(isinstance(g, idempotency._InFlight) for g in got) == 1
            assert _row(engine, key)["request_id"] == winners[0].request_id
            winners[0]._complete(200, {}, b"one generation", "json")
            loser = 1 - got.index(winners[0])
            again = idempotency._try(
                engines[loser], CTX, key, DIGEST, f"req_gw{loser}_{n}", 15.0, bills[loser]
            )
            assert isinstance(again, idempotency.Recorded) and again.body == b"one generation"
        rows = dict(_usage(engine))
        assert rows == {f"req_dead_{n}": n + 1 for n in range(rounds)}
    finally:
        for e in engines:
            e.dispose()


# ------------------------------------------------------------- the owner's lease


async def _begin(engine: Engine, key: str, rid: str, **kw: Any) -> Any:
    kw.setdefault("lease_s", 1.0)
    return await idempotency.begin(
        engine, CTX, key, DIGEST, rid, kw.pop("wait_s", 10.0), None, **kw
    )


async def test_the_owner_renews_its_lease_and_records_its_progress(engine, monkeypatch):
    monkeypatch.setattr(idempotency, "PROGRESS_EVERY_S", 0.2)
    claim = await _begin(engine, "k", "req_a")
    delivered = [0]
    claim.track(lambda: _charge("req_a", output=delivered[0]))
    seen: list[int] = []
    t0 = time.time()
    while time.time() - t0 < 3.0:  # three leases: it would have lapsed twice
        row = await asyncio.to_thread(_row, engine, "k")
        assert row["lease_until_s"] >= int(time.time()), "the lease lapsed while held"
        if row["progress"] is not None:
            seen.append(charge_from_json(row["progress"]).buckets.output_tokens)
        delivered[0] += 1
        await asyncio.sleep(0.1)
    # A retry meanwhile waits for it: the live claim is never taken over.
    with pytest.raises(ApiError) as info:
        await _begin(engine, "k", "req_b", wait_s=0.5)
    assert info.value.status == 409
    # Written at a bounded rate, and never more than was delivered when written.
    assert seen == sorted(seen) and seen[-1] >= delivered[0] - 6
    assert 5 <= len(set(seen)) <= 3.0 / 0.2 + 2
    await claim.complete(200, {}, b"done", "sse")
    row = _row(engine, "k")
    assert row["status"] == 200 and row["progress"] is None
    lease = row["lease_until_s"]
    await asyncio.sleep(0.6)  # stopped: no renewal lands after the outcome
    assert _row(engine, "k")["lease_until_s"] == lease


async def test_a_retry_takes_over_a_dead_owners_key_within_the_lease(engine):
    # The owner "dies": its keeper stops, nothing releases the key. The retry waits for
    # the lease to lapse (1 s, rounded up to whole seconds), takes the key over and
    # bills what the owner's stream had recorded: not an hour, not a 409.
    owner = await _begin(engine, "k", "req_a")
    owner.track(lambda: _charge("req_a", output=5))
    await asyncio.sleep(0.3)  # the first progress write
    assert _row(engine, "k")["progress"] is not None
    owner._keeper.cancel()
    bill = _ledger(engine)
    t0 = time.monotonic()
    retry = await _begin(engine, "k", "req_b", bill_cut=bill)
    waited = time.monotonic() - t0
    assert isinstance(retry, idempotency.Claim) and retry.request_id == "req_b"
    assert 0.5 < waited < 4.0
    assert _usage(engine) == [("req_a", 5)]
    await retry.release()
    assert _row(engine, "k") is None


async def test_an_owner_whose_key_was_taken_over_stops_and_says_so(engine, caplog):
    owner = await _begin(engine, "k", "req_a", lease_s=1.0)
    _set(engine, "k", request_id="req_other")  # a retry took it over
    await asyncio.wait_for(asyncio.wait({owner._keeper}), 3.0)
    assert any("lost its idempotency key" in r.getMessage() for r in caplog.records)
    await owner.complete(200, {}, b"late", "json")
    assert _row(engine, "k")["status"] is None  # the new owner's row is untouched


async def test_a_claim_dropped_unfinished_stops_renewing(engine):
    # A response that never ran (its client left before it started) holds a Claim
    # nobody will complete or release: once it is collected its lease lapses, so a
    # retry can take the key over rather than wait forever.
    claim = await _begin(engine, "k", "req_a")
    keeper = claim._keeper
    del claim
    gc.collect()
    await asyncio.wait_for(asyncio.wait({keeper}), 2.0)
    assert keeper.cancelled()


# ------------------------------------------------------------ ledger and migration


def test_a_charge_survives_json_and_garbage_is_refused():
    charge = _charge("req_a", output=9)
    assert charge_from_json(charge_to_json(charge)) == charge
    good = charge_to_json(charge)
    bad = [
        "",
        "[]",
        '{"buckets": {}}',
        good.replace('"output_tokens":9', '"output_tokens":-1'),
        good.replace('"output_tokens":9', '"output_tokens":1.5'),
        good.replace('"model":"m"', '"model":7'),
    ]
    for raw in bad:
        with pytest.raises(ValueError, match="not a recorded charge"):
            charge_from_json(raw)


def _alembic(conn: Any, rev: str, down: bool = False) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = conn
    (command.downgrade if down else command.upgrade)(cfg, rev)


def test_migration_0005_gives_rows_in_flight_the_legacy_hour_and_downgrades(db_url):
    eng = make_engine(db_url)
    try:
        with eng.begin() as conn:
            _alembic(conn, "0004")
            for key, status in (("busy", None), ("done", 200)):
                conn.execute(
                    text(
                        "INSERT INTO idempotency_keys (api_key_id, key, org_id, body_sha256,"
                        " request_id, status, kind, headers, created_at, created_s)"
                        " VALUES ('k', :key, 'o', 'd', :rid, :status, 'json', '{}', :t, 1000)"
                    ),
                    {"key": key, "rid": f"req_{key}", "status": status, "t": T0},
                )
        with eng.begin() as conn:
            _alembic(conn, "head")
            rows = dict(conn.execute(text("SELECT key, lease_until_s FROM idempotency_keys")).all())
        assert rows == {"busy": 1000 + 3600, "done": None}
        with eng.begin() as conn:
            _alembic(conn, "0004", down=True)
            cols = conn.execute(text("SELECT * FROM idempotency_keys")).keys()
            assert "lease_until_s" not in cols and "progress" not in cols
            _alembic(conn, "head")
    finally:
        eng.dispose()
