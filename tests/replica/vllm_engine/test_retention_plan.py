"""What a request may pin on vLLM (`retention.plan_pins`): kvcore's ledger decides,
ascending, and the first refusal stops the rest, as on the torch engine."""

from __future__ import annotations

from array import array

from cachepoint.kvcore import ManualClock, PinLedger, RetentionOwner, hash_blocks
from cachepoint.replica import admission
from cachepoint.replica.vllm_engine.pins import PARAMS_KEY, PinSpec
from cachepoint.replica.vllm_engine.retention import extend_at_end, plan_pins

B = 4


def _plan(tokens: list[int], positions: list[tuple[int, str]], owner: RetentionOwner):
    spans = [admission.EntrySpan(p, ttl, ("m", owner.key), owner=owner) for p, ttl in positions]
    toks = array("i", tokens)
    return admission.AdmissionPlan(toks, hash_blocks(toks, B, ("m", owner.key)), spans)


def test_each_breakpoint_is_granted_until_the_first_refusal():
    clock = ManualClock(0.0)
    ledger = PinLedger(40, retained_share=0.5, owner_share=0.5, clock=clock)  # quota 10
    a = RetentionOwner("org:a")
    plan = _plan(list(range(60)), [(2, "5m"), (16, "5m"), (36, "1h"), (56, "1h")], a)
    pins = plan_pins(ledger, plan, B)
    # 2 tokens: no full block, nothing to pin; 4 blocks; 9 blocks; 14 > quota 10
    assert [(s.blocks, s.ttl) for s in pins.specs] == [(4, 300.0), (9, 3600.0)]
    assert pins.refused_from == 56
    assert pins.reason == "tenant retention quota: 9 of 10 blocks retained, 5 more requested"
    assert [pins.retained(p) for p in (2, 16, 36, 56)] == [True, True, True, False]
    assert pins.params() == {
        PARAMS_KEY: {"pins": [{"key": s.key, "blocks": s.blocks, "ttl": s.ttl} for s in pins.specs]}
    }
    assert PinSpec.parse(pins.params()) == pins.specs  # what the connector reads back
    assert ledger.retained_owners() == {"org:a": 9}


def test_the_ledger_runs_to_the_requests_end_plus_its_ttl():
    clock = ManualClock(100.0)
    ledger = PinLedger(40, retained_share=1.0, clock=clock)
    plan = _plan(list(range(20)), [(16, "5m")], RetentionOwner("org:a"))
    pins = plan_pins(ledger, plan, B, ttl_scale=0.1)
    assert pins.specs[0].ttl == 30.0
    clock.advance(12.0)  # the request decoded for 12 s
    extend_at_end(ledger, pins)
    assert ledger.retained_until(plan.block_hashes[0]) == 142.0  # >= vLLM's own pin


def test_a_request_without_markers_pins_nothing():
    ledger = PinLedger(40)
    pins = plan_pins(ledger, _plan(list(range(20)), [], RetentionOwner("org:a")), B)
    assert pins.params() is None and len(ledger) == 0
