"""Ledger, tenants and reports against real SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from cachepoint.billing import Price, buckets, cost_micros
from cachepoint.gateway.billing.ledger import Charge, record
from cachepoint.gateway.billing.reports import (
    COST_GROUPS,
    USAGE_GROUPS,
    WIDTHS,
    cost_report,
    parse_query,
    usage_report,
)
from cachepoint.gateway.db.models import Base, UsageRecord
from cachepoint.gateway.tenancy.tenants import (
    authenticate,
    create_key,
    create_org,
    create_workspace,
    revoke_key,
    set_policy,
)

PRICE = Price(3_000_000, 15_000_000)
T0 = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)


def _charge(rid: str, org: str, key: str = "apikey_x", model: str = "m", ws=None, **b):
    bk = buckets(b.get("n", 100), b.get("read", 0), b.get("w5", 0), b.get("w1", 0), b.get("out", 5))
    return Charge(rid, org, ws, key, model, "r0", "org", bk)


def test_ledger_schema_matches_models(session):
    ctx = MigrationContext.configure(session.connection())
    assert compare_metadata(ctx, Base.metadata) == []


def test_ledger_request_id_bills_once(session):
    org = create_org(session, "acme")
    session.commit()
    assert record(session, _charge("req_1", org.id), PRICE, T0)
    assert not record(session, _charge("req_1", org.id, out=999), PRICE, T0)
    assert session.scalar(select(func.count()).select_from(UsageRecord)) == 1


def test_tenants_keys_hashed_revocable_and_scoped(session):
    org = create_org(session, "acme")
    ws = create_workspace(session, org, "prod")
    key, raw = create_key(session, org, workspace=ws)
    _admin, raw_admin = create_key(session, org, admin=True)
    session.commit()
    assert raw not in {key.key_hash, key.hint}
    assert len(key.key_hash) == 64
    ctx = authenticate(session, raw)
    assert ctx is not None
    assert (ctx.org_id, ctx.workspace_id, ctx.is_admin) == (org.id, ws.id, False)
    assert authenticate(session, raw_admin).is_admin
    assert authenticate(session, raw + "x") is None
    set_policy(session, org, allow_global=True, allowlist=["ab" * 32])
    session.commit()
    assert authenticate(session, raw).policy.allowlist == frozenset({"ab" * 32})
    revoke_key(session, key.id)
    session.commit()
    assert authenticate(session, raw) is None


@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(1, 5000), st.integers(0, 100), st.integers(0, 300)),
        min_size=1,
        max_size=12,
    )
)
def test_ledger_total_equals_sum_of_usage(session, turns):
    """Over a random session the ledger's totals equal what the client was told."""
    org = create_org(session, f"o{len(turns)}-{datetime.now().timestamp()}")
    session.commit()
    told = [0, 0, 0, 0, 0, 0]
    for i, (n, pct, out) in enumerate(turns):
        read = n * pct // 200
        w5 = (n - read) // 3
        b = buckets(n, read, w5, 0, out)
        record(session, Charge(f"r{org.id}{i}", org.id, None, "k", "m", "r", "org", b), PRICE, T0)
        for j, v in enumerate(
            (
                b.input_tokens,
                b.cache_read_input_tokens,
                b.cache_write_5m_tokens,
                b.cache_write_1h_tokens,
                b.output_tokens,
                cost_micros(b, PRICE),
            )
        ):
            told[j] += v
    q = parse_query(
        org.id,
        [("starting_at", T0.isoformat()), ("ending_at", (T0 + timedelta(days=1)).isoformat())],
        USAGE_GROUPS,
        WIDTHS,
    )
    (bucket,) = usage_report(session, q)["data"]
    (r,) = bucket["results"]
    got = [
        r["uncached_input_tokens"],
        r["cache_read_input_tokens"],
        r["cache_creation"]["ephemeral_5m_input_tokens"],
        r["cache_creation"]["ephemeral_1h_input_tokens"],
        r["output_tokens"],
    ]
    assert got == told[:5]
    cq = parse_query(
        org.id,
        [("starting_at", T0.isoformat()), ("ending_at", (T0 + timedelta(days=1)).isoformat())],
        COST_GROUPS,
        WIDTHS,
    )
    (cb,) = cost_report(session, cq, lambda m: PRICE)["data"]
    assert Decimal(cb["results"][0]["amount"]) * 10_000 == told[5]  # cents -> micro-dollars


def test_reports_buckets_groups_filters_and_paging(session):
    a = create_org(session, "a")
    b = create_org(session, "b")
    session.commit()
    for i in range(6):
        t = T0 + timedelta(hours=i)
        record(
            session,
            _charge(f"a{i}", a.id, model="m1" if i % 2 else "m2", key=f"k{i % 3}"),
            PRICE,
            t,
        )
        record(session, _charge(f"b{i}", b.id), PRICE, t)

    def q(org, hours=6, **params):
        items = [
            ("starting_at", T0.isoformat()),
            ("ending_at", (T0 + timedelta(hours=hours)).isoformat()),
        ]
        for k, v in params.items():
            items += [(k, x) for x in (v if isinstance(v, list) else [v])]
        return parse_query(org, items, USAGE_GROUPS, WIDTHS)

    hourly = usage_report(session, q(a.id, bucket_width="1h"))
    assert len(hourly["data"]) == 6
    assert all(len(d["results"]) == 1 for d in hourly["data"])
    assert hourly["data"][0]["starting_at"] == "2026-11-30T10:00:00Z"
    # A day bucket is only returned once it ends before ending_at.
    assert all(not d["results"] for d in usage_report(session, q(a.id, bucket_width="1d"))["data"])
    by_model = usage_report(session, q(a.id, 24, bucket_width="1d", **{"group_by[]": "model"}))
    (day,) = [d for d in by_model["data"] if d["results"]]
    assert sorted((r["model"], r["output_tokens"]) for r in day["results"]) == [
        ("m1", 15),
        ("m2", 15),
    ]
    filtered = usage_report(session, q(a.id, bucket_width="1h", models="m1"))
    assert sum(bool(d["results"]) for d in filtered["data"]) == 3
    page1 = usage_report(session, q(a.id, bucket_width="1h", limit="4"))
    assert page1["has_more"]
    assert len(page1["data"]) == 4
    page2 = usage_report(session, q(a.id, bucket_width="1h", limit="4", page=page1["next_page"]))
    assert [d["starting_at"] for d in page2["data"]] == [
        "2026-11-30T14:00:00Z",
        "2026-11-30T15:00:00Z",
    ]
    assert not page2["has_more"]
    # Org b's rows never show up in org a's report.
    total_a = sum(r["output_tokens"] for d in hourly["data"] for r in d["results"])
    assert total_a == 30
    by_desc = cost_report(
        session,
        parse_query(
            a.id,
            [("starting_at", T0.isoformat()), ("group_by", "description")],
            COST_GROUPS,
            WIDTHS,
        ),
        lambda m: PRICE,
    )
    kinds = {r["token_type"] for d in by_desc["data"] for r in d["results"]}
    assert kinds == {"uncached_input_tokens", "output_tokens"}
