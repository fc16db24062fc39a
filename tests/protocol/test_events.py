"""cachepoint.protocol's NDJSON events: every event survives encode -> decode, the
decoding is strict where the gateway bills, and what is not an event says so."""

from __future__ import annotations

import json

import pytest

from cachepoint.protocol import (
    EVENT_TYPES,
    CacheReport,
    DoneEvent,
    ErrorEvent,
    Event,
    GenerateResponse,
    MalformedEvent,
    PrefillDoneEvent,
    Timings,
    TokenEvent,
    decode_event,
    encode_event,
    event_name,
)

REPORT = CacheReport(
    prompt_tokens=100,
    engine_hit_tokens=64,
    promoted_tokens=16,
    computed_tokens=36,
    entry_hit_tokens=64,
    entry_hit_lookback=1,
    written_5m_tokens=20,
    written_1h_tokens=10,
    retention_refused=True,
    refusal_reason="quota",
    retention="best_effort",
    retention_reason="vllm",
    scope_narrowed=True,
)
RESPONSE = GenerateResponse(
    request_id="req_1",
    replica="r0",
    epoch=3,
    model="m",
    output_token_ids=[5, 6],
    text="hé",
    stop_reason="stop_sequence",
    stop_sequence="\n",
    output_tokens=2,
    cache=REPORT,
    timings=Timings(queue_s=0.5, prefill_s=0.25, decode_s=1.0, ttft_s=0.75, preemptions=2),
)
EVENTS: list[Event] = [
    PrefillDoneEvent(cache=REPORT),
    TokenEvent(token_id=7, text="€"),
    TokenEvent(token_id=8, text=""),
    DoneEvent(response=RESPONSE),
    ErrorEvent.of("overloaded_error", "pool full"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: Event) -> None:
    line = encode_event(event)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_event(line) == event
    assert decode_event(line.decode()) == event  # as httpx hands lines over: str
    assert json.loads(line)["type"] == event_name(type(event))


def test_event_names_are_one_per_type() -> None:
    assert set(EVENT_TYPES) == {"prefill_done", "token", "done", "error"}
    assert all(event_name(cls) == name for name, cls in EVENT_TYPES.items())


def test_lines_are_what_the_gateway_read_before_the_types() -> None:
    # The same JSON objects as the hand-written lines (any peer built on those reads them).
    assert json.loads(encode_event(TokenEvent(token_id=3, text="ab"))) == {
        "type": "token",
        "token_id": 3,
        "text": "ab",
    }
    assert json.loads(encode_event(ErrorEvent.of("api_error", "boom"))) == {
        "type": "error",
        "error": {"type": "api_error", "message": "boom"},
    }
    line = json.loads(encode_event(PrefillDoneEvent(cache=REPORT)))
    assert line == {"type": "prefill_done", "cache": REPORT.model_dump()}


def _prefill(**cache: object) -> str:
    base = {"prompt_tokens": 5, "entry_hit_tokens": 0, "written_5m_tokens": 0}
    return json.dumps({"type": "prefill_done", "cache": {**base, "written_1h_tokens": 0, **cache}})


def test_a_report_of_the_billed_counts_alone_is_read() -> None:
    # An older or simpler replica may send only what is billed; the rest has defaults.
    event = decode_event(_prefill(engine_hit_tokens=2))
    assert isinstance(event, PrefillDoneEvent)
    assert event.cache.computed_tokens == 3 and event.cache.entry_hit_lookback is None


@pytest.mark.parametrize("bad", [1.5, True, "5", None, -1.0])
def test_billed_counts_must_be_json_integers(bad: object) -> None:
    with pytest.raises(MalformedEvent) as info:
        decode_event(_prefill(written_5m_tokens=bad))
    assert info.value.event is PrefillDoneEvent and info.value.reports_usage
    assert "written_5m_tokens" in info.value.detail


def test_a_done_event_carries_usage_and_a_token_event_does_not() -> None:
    done = json.loads(encode_event(DoneEvent(response=RESPONSE)))
    done["response"]["stop_reason"] = "because"
    with pytest.raises(MalformedEvent) as info:
        decode_event(json.dumps(done))
    assert info.value.event is DoneEvent and info.value.reports_usage
    with pytest.raises(MalformedEvent) as info:
        decode_event('{"type":"token","token_id":1}')
    assert info.value.event is TokenEvent and not info.value.reports_usage


def test_a_newer_peers_event_type_is_skipped() -> None:
    assert decode_event('{"type":"heartbeat","at":1}') is None


@pytest.mark.parametrize("line", ["nope", "[1, 2]", '{"token_id": 3}', "null", '"token"'])
def test_what_is_no_event_is_malformed(line: str) -> None:
    with pytest.raises(MalformedEvent) as info:
        decode_event(line)
    assert info.value.event is None and not info.value.reports_usage


def test_an_error_without_a_kind_is_an_internal_one() -> None:
    event = decode_event('{"type":"error","error":{"message":"x"}}')
    assert event == ErrorEvent.of("api_error", "x")
