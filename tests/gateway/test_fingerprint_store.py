"""The fingerprint store: memory answers the turns this gateway saw, without touching
the database; the row is written with the ledger row, in its transaction; another
gateway (or this one after a restart) finds it there."""

from __future__ import annotations

from sqlalchemy import event, func, select

from cachepoint.billing import Price, buckets
from cachepoint.gateway.billing.ledger import Charge, record_on
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.models import PromptFingerprint
from cachepoint.gateway.db.session import make_engine
from cachepoint.gateway.diagnostics import FingerprintStore
from cachepoint.kvcore import ManualClock

from .test_fingerprint import M0, M1, SYSTEM, fp, render

PRICE = Price(3_000_000, 15_000_000)
FIRST = fp(render([], SYSTEM, [M0]))
LATER = fp(render([], SYSTEM, [M0, M1]))
CHANGED = fp(render([], SYSTEM[:40] + [7] * 60, [M0, M1]))


def _engine(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path}/l.db")
    upgrade(engine)
    return engine


def _bill(engine, store: FingerprintStore, rid: str, org: str = "o1") -> None:
    """As GatewayState.bill does: the ledger row and the fingerprint row in one go."""
    charge = Charge(rid, org, None, "k1", "m", "r0", "org", buckets(200, 0, 160, 0, 4))
    assert record_on(engine, charge, PRICE, also=store.writer(rid))
    store.billed(rid, replica="r0", at_s=int(store.clock()), kept_tokens=160)


def _count_queries(engine) -> list[str]:
    seen: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    return seen


def ask(store: FingerprintStore, cur, previous: str | None, org: str = "o1", **kw):
    return store.diagnose_recent(
        org_id=org, workspace_id=None, fp=cur, opted_in=True, previous_id=previous, **kw
    )


def test_memory_answers_without_the_database_and_the_row_rides_with_the_ledger(tmp_path):
    engine = _engine(tmp_path)
    clock = ManualClock(1_000_000.0)
    store = FingerprintStore(engine, 7200, clock=clock)
    queries = _count_queries(engine)
    store.remember("msg_1", "o1", None, None, "k1", FIRST)
    assert queries == []  # kept in memory only, until billed
    _bill(engine, store, "req_1")
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(PromptFingerprint)).scalar() == 1
    queries.clear()
    d = ask(store, CHANGED, "msg_1")
    assert d is not None and d.reason == "system_changed"
    assert d.previous is not None and (d.previous.replica, d.previous.kept) == ("r0", 160)
    assert ask(store, LATER, "msg_1").reason == "none"
    assert queries == []  # memory answered both
    # Another org naming it: not found, the same answer as an unknown id.
    assert ask(store, LATER, "msg_1", org="o2").reason == "previous_message_not_found"
    # An id memory does not hold: the database must say (None: ask it).
    assert ask(store, LATER, "msg_unknown") is None


def test_another_gateway_finds_the_turn_in_the_database(tmp_path):
    engine = _engine(tmp_path)
    here = FingerprintStore(engine, 7200)
    here.remember("msg_1", "o1", None, "s1", "k1", FIRST)
    _bill(engine, here, "req_1")
    there = FingerprintStore(engine, 7200)
    assert ask(there, CHANGED, "msg_1") is None  # not in its memory
    kw = {"org_id": "o1", "workspace_id": None, "fp": CHANGED}
    d = there.diagnose(**kw, opted_in=True, previous_id="msg_1")
    assert d.reason == "system_changed" and d.previous is not None
    # The session path too: the session's turn, from the database.
    d = there.diagnose(**kw, opted_in=False, previous_id=None, session_id="s1")
    assert d.reason == "system_changed" and d.answer is None
    # A turn remembered but never billed (a request that failed) was never written.
    here.remember("msg_2", "o1", None, "s1", "k1", FIRST)
    assert there.diagnose(**kw, opted_in=True, previous_id="msg_2").reason == (
        "previous_message_not_found"
    )


def test_memory_is_bounded_and_ages_out(tmp_path):
    engine = _engine(tmp_path)
    clock = ManualClock(1_000_000.0)
    store = FingerprintStore(engine, 3600, clock=clock, memory_turns=2)
    for i in range(3):
        store.remember(f"msg_{i}", "o1", None, "s1", "k1", FIRST)
    assert ask(store, LATER, "msg_0") is None  # pushed out: ask the database
    assert ask(store, LATER, "msg_2").reason == "none"
    # The session path: the session's recent turns, newest first.
    d = store.diagnose_recent(
        org_id="o1", workspace_id=None, fp=LATER, opted_in=False, previous_id=None,
        session_id="s1",
    )  # fmt: skip
    assert d is not None and d.reason == "none"
    clock.advance(3601)
    assert ask(store, LATER, "msg_2") is None  # too old for memory: the database decides
    d = store.diagnose(org_id="o1", workspace_id=None, fp=LATER, opted_in=True, previous_id="msg_2")
    assert d.reason == "previous_message_not_found"  # and it never had it: never billed


def test_a_sessions_first_turn_continues_the_keys_last_session_from_memory(tmp_path):
    engine = _engine(tmp_path)
    store = FingerprintStore(engine, 7200)
    store.remember("msg_1", "o1", None, "s1", "k1", FIRST)
    kw = {"org_id": "o1", "workspace_id": None, "opted_in": False, "previous_id": None}
    d = store.diagnose_recent(**kw, fp=CHANGED, session_id="s2", api_key_id="k1")
    assert d is not None and d.reason == "system_changed"
    unrelated = fp(render([], [9] * 100, [M0]))
    d = store.diagnose_recent(**kw, fp=unrelated, session_id="s3", api_key_id="k1")
    assert d is not None and d.reason is None  # shares no block: not compared
    # A key this gateway never saw: the database decides.
    assert store.diagnose_recent(**kw, fp=CHANGED, session_id="s4", api_key_id="k9") is None


def test_a_fingerprint_row_is_written_once_and_only_with_a_new_ledger_row(tmp_path):
    engine = _engine(tmp_path)
    store = FingerprintStore(engine, 7200)
    store.remember("msg_1", "o1", None, None, "k1", FIRST)
    _bill(engine, store, "req_1")
    assert store.writer("req_1") is None  # stored: nothing more to write
    charge = Charge("req_1", "o1", None, "k1", "m", "r0", "org", buckets(1, 0, 0, 0, 1))
    assert not record_on(engine, charge, PRICE)  # the same request again: refused
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(PromptFingerprint)).scalar() == 1
