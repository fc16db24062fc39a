"""Report ranges at the edges of the calendar: the last days of
9999 gave a 500 (OverflowError in the bucket arithmetic) on both report endpoints, and
year 1 came out as "1-01-01T00:00:00Z", which is not RFC 3339."""

from __future__ import annotations

import base64
import re
from datetime import UTC, datetime, timedelta, timezone

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachepoint.billing import Price, buckets
from cachepoint.gateway.billing.ledger import Charge, record
from cachepoint.gateway.billing.reports import (
    LIMITS,
    USAGE_GROUPS,
    WIDTHS,
    ReportError,
    cost_report,
    parse_query,
    rfc3339,
    usage_report,
)
from cachepoint.gateway.db.migrate import upgrade
from cachepoint.gateway.db.session import make_engine, make_sessionmaker
from cachepoint.gateway.tenancy.tenants import get_org

RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
ENDPOINTS = ("/v1/organizations/usage_report/messages", "/v1/organizations/cost_report")
RANGE = "0001-01-01T00:00:00Z to 9999-12-31T23:59:59Z"
PRICE = Price(3_000_000, 15_000_000)


@pytest.fixture
def gateway(seeded_db, serve, free_port):
    """A gateway on the seeded ledger (reports need no replica): (url, admin headers)."""
    from cachepoint.gateway.app import create_app
    from cachepoint.gateway.settings import GatewaySettings

    db, keys = seeded_db
    settings = GatewaySettings(database_url=db, replica_urls=[f"http://127.0.0.1:{free_port()}"])
    return serve(create_app(settings)), {"x-api-key": keys["a-admin"]}, db


def _bill(db: str, at: datetime, out: int = 7) -> None:
    engine = make_engine(db)
    with make_sessionmaker(engine)() as s:
        org = get_org(s, "a")
        charge = Charge(
            f"req_{at.isoformat()}", org.id, None, "k", "m", "r0", "org", buckets(100, 0, 0, 0, out)
        )
        record(s, charge, PRICE, at)
    engine.dispose()


def _all_timestamps(report: dict) -> list[str]:
    return [d[k] for d in report["data"] for k in ("starting_at", "ending_at")]


@pytest.mark.parametrize("path", ENDPOINTS)
def test_reports_at_the_end_of_year_9999(gateway, path):
    url, headers, _ = gateway
    # The last whole days and hours of the calendar: a 200, never a 500.
    r = httpx.get(
        url + path,
        params={"starting_at": "9999-12-25T00:00:00Z", "ending_at": "9999-12-31T23:59:59Z"},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    starts = [d["starting_at"] for d in body["data"]]
    assert starts == [f"9999-12-{day}T00:00:00Z" for day in range(25, 31)]
    assert body["data"][-1]["ending_at"] == "9999-12-31T00:00:00Z"
    assert not body["has_more"]
    assert body["next_page"] is None
    # Paging through the last hours: every page parses, the last bucket ends at 23:00
    # (the 23:00 bucket would end in year 10000, past ending_at).
    params = {
        "starting_at": "9999-12-31T00:00:00Z",
        "ending_at": "9999-12-31T23:59:59Z",
        "bucket_width": "1h",
        "limit": "10",
    }
    seen: list[str] = []
    while True:
        r = httpx.get(url + path, params=params, headers=headers)
        assert r.status_code == 200, r.text
        body = r.json()
        seen += _all_timestamps(body)
        if not body["has_more"]:
            break
        params["page"] = body["next_page"]
    assert all(RFC3339.fullmatch(t) for t in seen)
    assert seen[0] == "9999-12-31T00:00:00Z"
    assert seen[-1] == "9999-12-31T23:00:00Z"
    assert len(seen) == 2 * 23


@pytest.mark.parametrize("path", ENDPOINTS)
def test_reports_in_year_1_are_rfc3339(gateway, path):
    url, headers, db = gateway
    _bill(db, datetime(1, 1, 1, 1, 5, tzinfo=UTC))
    params = {
        "starting_at": "0001-01-01T00:00:00Z",
        "ending_at": "0001-01-01T04:00:00Z",
        "bucket_width": "1h",
        "limit": "2",
    }
    r = httpx.get(url + path, params=params, headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["starting_at"] for d in body["data"]] == [
        "0001-01-01T00:00:00Z",
        "0001-01-01T01:00:00Z",
    ]
    assert body["data"][1]["ending_at"] == "0001-01-01T02:00:00Z"
    # The row billed at 01:05 is in the 01:00 bucket, not a neighbour.
    assert [bool(d["results"]) for d in body["data"]] == [False, True]
    assert body["has_more"]
    token = body["next_page"].removeprefix("page_")
    assert base64.urlsafe_b64decode(token).decode() == "0001-01-01T02:00:00Z"
    r = httpx.get(url + path, params=params | {"page": body["next_page"]}, headers=headers)
    assert [d["starting_at"] for d in r.json()["data"]] == [
        "0001-01-01T02:00:00Z",
        "0001-01-01T03:00:00Z",
    ]


def _forged_page(text: str) -> str:
    return "page_" + base64.urlsafe_b64encode(text.encode()).decode()


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"starting_at": "0001-01-01T00:00:00+01:00"}, "starting_at"),
        (
            {"starting_at": "9999-12-30T00:00:00Z", "ending_at": "9999-12-31T23:00:00-01:00"},
            "ending_at",
        ),
        (
            {"starting_at": "2026-01-01T00:00:00Z", "page": _forged_page("0001-01-01T00:00+05:00")},
            "page",
        ),
    ],
)
def test_reports_outside_the_calendar_are_a_400(gateway, path, params, name):
    """A time whose UTC equivalent has no datetime (year 0, year 10000) names the
    parameter and the supported range, in the Anthropic envelope."""
    url, headers, _ = gateway
    r = httpx.get(url + path, params=params, headers=headers)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(f"{name}: ")
    assert RANGE in body["error"]["message"]
    assert body["request_id"]


def test_rfc3339_pads_the_year():
    assert rfc3339(datetime(1, 1, 1, tzinfo=UTC)) == "0001-01-01T00:00:00Z"
    assert rfc3339(datetime(999, 12, 31, 23, 59, 59, tzinfo=UTC)) == "0999-12-31T23:59:59Z"
    # Another offset is shown in UTC.
    east = timezone(timedelta(hours=2))
    assert rfc3339(datetime(2026, 1, 1, 1, 0, tzinfo=east)) == "2025-12-31T23:00:00Z"


@pytest.fixture(scope="module")
def ledger(tmp_path_factory):
    """One migrated, empty SQLite ledger for the property test's many queries."""
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('dates')}/ledger.db")
    upgrade(engine)
    with make_sessionmaker(engine)() as s:
        yield s
    engine.dispose()


offsets = st.integers(-23 * 60, 23 * 60).map(lambda m: timezone(timedelta(minutes=m)))


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    start=st.datetimes(timezones=st.just(UTC) | offsets),
    span=st.integers(0, 40 * 86400),
    width=st.sampled_from(sorted(WIDTHS)),
    data=st.data(),
)
def test_any_range_is_a_report_or_a_400(ledger, start, span, width, data):
    """Over the whole calendar, in any offset: parse_query refuses with a ReportError or
    the report's buckets are contiguous, RFC 3339, and end by ending_at."""
    limit = data.draw(st.integers(1, LIMITS[width][1]))
    try:
        end = start + timedelta(seconds=span)
    except OverflowError:
        end = datetime.max.replace(tzinfo=start.tzinfo)
    params = [
        ("starting_at", start.isoformat()),
        ("ending_at", end.isoformat()),
        ("bucket_width", width),
        ("limit", str(limit)),
    ]
    try:
        q = parse_query("org_x", params, USAGE_GROUPS, WIDTHS)
    except ReportError:
        return
    for report in (usage_report(ledger, q), cost_report(ledger, q, lambda m: PRICE)):
        stamps = _all_timestamps(report)
        assert all(RFC3339.fullmatch(t) for t in stamps)
        got = [datetime.fromisoformat(t.replace("Z", "+00:00")) for t in stamps]
        step = timedelta(seconds=WIDTHS[width])
        assert all(b - a == step for a, b in zip(got[::2], got[1::2], strict=True))
        assert got[1::2] == got[2::2] + got[-1:]  # each bucket starts where the last ended
        assert len(report["data"]) <= limit
        if got:
            assert got[0] == q.start
            assert got[-1] <= q.end
        if report["has_more"]:
            token = report["next_page"].removeprefix("page_")
            assert base64.urlsafe_b64decode(token).decode() == stamps[-1]
