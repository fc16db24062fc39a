"""The reasons only the server knows for a turn whose prompt only appended yet read less
than the turn before cached: what happened to the cache entry, from the two turns'
ledger records and the replica it reached (gateway/diagnostics.py, `outcome_reason`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cachepoint.billing import buckets
from cachepoint.gateway.accounting import charge_of
from cachepoint.gateway.billing.ledger import Attribution
from cachepoint.gateway.contract.breakpoints import ScopePolicy
from cachepoint.gateway.contract.template import build_renderer
from cachepoint.gateway.diagnostics import PreviousTurn, outcome_reason
from cachepoint.gateway.pipeline import prepare
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.tenants import KeyContext

PREV = PreviousTurn(replica="r0", at_s=1_000, ttl_s=300, cached_end=512, kept=512)


@pytest.mark.parametrize(
    ("prev", "replica", "read", "now", "started", "why"),
    [
        (PREV, "r0", 512, 1_100, None, None),  # read all of it: no miss
        (PREV, "r0", 512 + 64, 1_100, None, None),
        (PreviousTurn("r0", 1_000, 300, 512, 100), "r0", 0, 1_100, None, "not_retained"),
        (PREV, "r1", 0, 1_100, None, "routed_elsewhere"),
        (PREV, "r0", 0, 1_100, 1_050.0, "replica_restarted"),
        (PREV, "r0", 0, 1_301, 900.0, "entry_expired"),
        (PreviousTurn("r0", 1_000, 3600, 512, 512), "r0", 0, 1_301, None, "entry_evicted"),
        (PREV, "r0", 256, 1_100, None, "entry_evicted"),  # part of it was gone
        (PreviousTurn("r0", 1_000, 300, 0, 0), "r0", 0, 9_999, None, None),  # nothing cached
    ],
)
def test_what_happened_to_the_entry(prev, replica, read, now, started, why):
    got = outcome_reason(prev, replica=replica, read=read, now_s=now, replica_started_s=started)
    assert got == why


def _prepared():
    settings = GatewaySettings(models=["cachepoint-tiny"], min_cacheable_tokens=0)
    body = MessagesRequest(
        model="cachepoint-tiny",
        max_tokens=4,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello " * 20}]}],
    )
    ctx = KeyContext("k", "org1", None, False, ScopePolicy())
    kw = {"ctx": ctx, "betas": set(), "settings": settings, "renderer": build_renderer(None)}
    return body, ctx, prepare(body, **kw, request_id="req_1")


def test_the_ledger_gets_the_outcome_only_when_the_prompt_only_appended():
    body, ctx, p = _prepared()
    b = buckets(600, 0, 600, 0, 4)  # read nothing of the 512 the turn before cached
    appended = replace(p, who=Attribution(miss_reason="none"), previous=PREV)
    charge = charge_of("req_1", ctx, body, "r1", appended, b)
    assert (charge.who.miss_reason, charge.who.miss_tokens) == ("routed_elsewhere", 512)
    assert charge.who.miss_detail == "entry on r0"
    # A prompt change keeps its own reason: the outcome would only follow from it.
    changed = replace(p, who=Attribution(miss_reason="system_changed", miss_tokens=500))
    changed = replace(changed, previous=PREV)
    charge = charge_of("req_1", ctx, body, "r1", changed, b)
    assert (charge.who.miss_reason, charge.who.miss_tokens) == ("system_changed", 500)
    # Read it all: "none" stays.
    full = buckets(600, 512, 88, 0, 4)
    assert charge_of("req_1", ctx, body, "r0", appended, full).who.miss_reason == "none"


def test_an_evicted_entry_names_the_tier_its_first_missed_block_was_last_in():
    body, ctx, p = _prepared()
    appended = replace(p, who=Attribution(miss_reason="none"), previous=PREV)
    asked = []

    def evicted_from(token):
        asked.append(token)
        return "host"

    b = buckets(600, 256, 344, 0, 4)  # read 256 of the 512: the block at 256 was gone
    kw = {"now_s": 1_100.0, "evicted_from": evicted_from}
    charge = charge_of("req_1", ctx, body, "r0", appended, b, None, **kw)
    assert (charge.who.miss_reason, charge.who.miss_tokens) == ("entry_evicted", 256)
    assert (charge.who.miss_detail, asked) == ("tier host", [256])
    # Unknown (no events, say): the reason stands alone.
    kw = {"now_s": 1_100.0, "evicted_from": lambda token: None}
    charge = charge_of("req_1", ctx, body, "r0", appended, b, None, **kw)
    assert (charge.who.miss_reason, charge.who.miss_detail) == ("entry_evicted", None)
    # Expired is expired, whatever the tier.
    charge = charge_of(
        "req_1", ctx, body, "r0", appended, b, None, now_s=1_400.0, **{"evicted_from": evicted_from}
    )
    assert (charge.who.miss_reason, charge.who.miss_detail) == ("entry_expired", None)
