"""Per-org retention quotas on the replica: admission charges entries to their owner,
and the HTTP API carries the owner and its share."""

from __future__ import annotations

import httpx
import pytest

from cachepoint.engine import Engine
from cachepoint.kvcore import UNATTRIBUTED, BlockPool, KVCacheManager, ManualClock
from cachepoint.replica import admission
from cachepoint.replica.api.app import create_app
from cachepoint.replica.settings import ReplicaSettings

B = 4


def _run(manager: KVCacheManager, tokens: list[int], owner: str | None, share=None):
    """Admission, a (pretend) successful prefill, commit and the entry writes."""
    who = admission.retention_owner(owner, share)
    bps = [admission.EntrySpan(len(tokens), "1h", ("m", f"org:{owner}"), owner=who)]
    cp = admission.plan(manager, tokens, admission.key_schedule([(0, ["m"])]), bps)
    alloc = manager.allocate(cp.block_hashes, len(tokens) + 1)
    alloc.commit()
    admission.write_entries(manager, cp)
    alloc.free()
    return cp


def test_admission_charges_each_org_and_refuses_past_its_quota():
    # 64 blocks, 32 may be retained, each org 16 (owner_share 0.5).
    pool = BlockPool(64, B, retained_share=0.5, owner_share=0.5, clock=ManualClock(0.0))
    manager = KVCacheManager(pool)
    first = _run(manager, list(range(40)), "org:a")  # 10 blocks
    assert first.refusal_reason is None
    over = _run(manager, list(range(100, 140)), "org:a")  # 10 more: 20 > 16
    assert (
        over.refusal_reason == "tenant retention quota: 10 of 16 blocks retained, 10 more requested"
    )
    assert admission.written_tokens(over) == (0, 0)  # billed as input, never as a write
    other = _run(manager, list(range(200, 240)), "org:b")
    assert other.refusal_reason is None
    assert admission.written_tokens(other) == (0, 40)
    assert pool.retained_owners() == {"org:a": 10, "org:b": 10}
    # A per-org share from the gateway overrides the replica default.
    big = _run(manager, list(range(100, 140)), "org:a", share=1.0)
    assert big.refusal_reason is None
    pool.check_invariants()


def test_admission_without_an_owner_is_one_shared_tenant():
    assert admission.retention_owner(None, None) == UNATTRIBUTED
    pool = BlockPool(64, B, retained_share=0.5, owner_share=0.5, clock=ManualClock(0.0))
    manager = KVCacheManager(pool)
    assert _run(manager, list(range(40)), None).refusal_reason is None
    over = _run(manager, list(range(100, 140)), None)
    assert over.refusal_reason is not None
    assert over.refusal_reason.startswith("tenant retention quota")


# ------------------------------------------------------------------ the HTTP API


@pytest.fixture
def base_url(engine: Engine, sink, serve) -> str:
    # The shared engine has 256 blocks of 16: 128 may be retained, each org 32.
    settings = ReplicaSettings(
        name="r-quota", max_num_batched_tokens=512, retained_share=0.5, org_retained_share=0.25
    )
    return serve(create_app(settings, engine, sink=sink))


def _generate(base_url: str, first: int, **owner) -> dict:
    # 300 tokens (the vocabulary is bytes): an entry over 18 full blocks of 16.
    tokens = [first, *(1 + i % 250 for i in range(299))]
    body = {"token_ids": tokens, "max_tokens": 1, "breakpoints": [{"position": 300, "ttl": "1h"}]}
    r = httpx.post(f"{base_url}/v1/generate", json=body | owner)
    assert r.status_code == 200, r.text
    return r.json()["cache"]


def test_api_reports_a_quota_refusal_and_spares_other_orgs(base_url: str):
    a = {"retention_owner": "org:a"}
    assert _generate(base_url, 201, **a)["written_1h_tokens"] == 300
    refused = _generate(base_url, 202, **a)
    assert refused["retention_refused"] is True
    assert refused["refusal_reason"] == (
        "tenant retention quota: 18 of 32 blocks retained, 18 more requested"
    )
    assert (refused["written_1h_tokens"], refused["written_5m_tokens"]) == (0, 0)
    b = _generate(base_url, 202, retention_owner="org:b")  # the same tokens, another org
    assert (b["retention_refused"], b["written_1h_tokens"]) == (False, 300)
    # The gateway's per-org share: 0 means this org may retain nothing at all.
    zero = _generate(base_url, 203, retention_owner="org:c", owner_retained_share=0.0)
    assert zero["retention_refused"] is True
    # An old gateway that names no owner still works (one shared tenant).
    assert _generate(base_url, 204)["written_1h_tokens"] == 300
    stats = httpx.get(f"{base_url}/v1/stats").json()
    assert stats["blocks"]["retained"] == 3 * 18
    # Operators see the quota at work: org a, org b and the no-owner tenant hold blocks;
    # org a's and org c's refusals were the quota's.
    assert stats["blocks"]["retained_owners"] == 3
    assert stats["quota_refusals"] == stats["retain_refusals"] == 2
    scraped = httpx.get(f"{base_url}/metrics").text
    assert 'cachepoint_retention_quota_refusals_total{replica="r-quota"} 2.0' in scraped
    assert 'cachepoint_retention_owners{replica="r-quota"} 3.0' in scraped
    assert "org:a" not in scraped  # open to scrapers: never a tenant's name


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"owner_retained_share": 1.5}, "owner_retained_share"),
        ({"owner_retained_share": -0.1}, "owner_retained_share"),
        ({"owner_retained_share": True}, "owner_retained_share"),
        ({"retention_owner": ""}, "retention_owner"),
        ({"retention_owner": "x" * 129}, "retention_owner"),
    ],
)
def test_api_rejects_bad_owner_fields(base_url: str, extra: dict, message: str):
    body = {"token_ids": [1, 2, 3], "max_tokens": 1} | extra
    r = httpx.post(f"{base_url}/v1/generate", json=body)
    assert r.status_code == 400, r.text
    assert message in r.text
