"""Both trace formats: parsing, validation errors, writing, and recording from hashes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachepoint.kvcore import hash_blocks
from cachepoint.sim.trace import (
    TraceBreakpoint,
    TraceError,
    TraceRecorder,
    dump_trace,
    load_trace,
    parse_trace,
)

from .conftest import cachepoint_lines, tiny_trace

MOONCAKE = [
    '{"timestamp": 2000, "input_length": 1030, "output_length": 7, "hash_ids": [0, 1, 2]}',
    '{"timestamp": 1000, "input_length": 600, "output_length": 3, "hash_ids": [0, 9]}',
    "",
]


def test_mooncake_lines_parse_sorted_with_seconds_from_the_first_arrival():
    trace = parse_trace(MOONCAKE, source="m")
    assert trace.format == "mooncake"
    assert trace.block_tokens == 512
    assert [r.arrival_s for r in trace.requests] == [0.0, 1.0]
    assert trace.requests[0].hash_ids == (0, 9)
    assert trace.requests[1].output_length == 7
    assert trace.requests[1].tenant is None


def test_cachepoint_format_carries_tenant_and_breakpoints():
    trace = tiny_trace(
        [
            {
                "timestamp": 0,
                "input_length": 10,
                "output_length": 1,
                "hash_ids": [1, 2, 3],
                "tenant": "acme",
                "breakpoints": [{"tokens": 4, "ttl": "1h"}, {"tokens": 10}],
            }
        ]
    )
    req = trace.requests[0]
    assert trace.format == "cachepoint"
    assert trace.block_tokens == 4
    assert req.tenant == "acme"
    assert req.breakpoints == (TraceBreakpoint(4, "1h"), TraceBreakpoint(10, "5m"))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 4, "output_length": 1, "hash_ids": [1]}', "missing field 'timestamp'"),
        ('{"timestamp": -1, "input_length": 4, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 9, "output_length": 1, "hash_ids": [1]}', "need 3"),
        ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ],
)
def test_bad_request_lines_name_the_line(line: str, message: str):
    lines = cachepoint_lines([])
    with pytest.raises(TraceError, match=message) as info:
        parse_trace([*lines, line], source="t.jsonl")
    assert "t.jsonl:2" in str(info.value)


@pytest.mark.parametrize(
    ("breakpoints", "message"),
    [
        ([{"tokens": 1}] * 5, "at most 4"),
        ([{"tokens": 13}], "past the prompt"),
        ([{"tokens": 8}, {"tokens": 4}], "increasing"),
        ([{"tokens": 4, "ttl": "5m"}, {"tokens": 8, "ttl": "1h"}], "1h breakpoint"),
        ([{"tokens": 4, "ttl": "2h"}], "ttl must be one of"),
    ],
)
def test_bad_breakpoints_are_rejected(breakpoints: list[dict[str, object]], message: str):
    req = {"timestamp": 0, "input_length": 12, "output_length": 0, "hash_ids": [1, 2, 3]}
    with pytest.raises(TraceError, match=message):
        tiny_trace([{**req, "breakpoints": breakpoints}])


def test_header_errors_and_empty_traces():
    with pytest.raises(TraceError, match="version 2 is not supported"):
        parse_trace(['{"format": "cachepoint-trace", "version": 2, "block_tokens": 4}'])
    with pytest.raises(TraceError, match="unknown trace format"):
        parse_trace(['{"format": "other"}'])
    with pytest.raises(TraceError, match="holds no requests"):
        parse_trace(["", "  "], source="empty.jsonl")


def test_load_trace_errors_for_missing_and_binary_files(tmp_path: Path):
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="not a file"):
        load_trace(tmp_path)
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_trace(binary)


def test_dump_then_parse_round_trips(sessions):
    again = parse_trace(dump_trace(sessions), source="again")
    assert again.requests == sessions.requests
    assert again.block_tokens == sessions.block_tokens
    header = json.loads(next(iter(dump_trace(sessions))))
    assert header == {"format": "cachepoint-trace", "version": 1, "block_tokens": 4}


def test_recorder_keeps_exactly_the_traffic_sharing_and_no_content():
    rec = TraceRecorder(block_tokens=4)
    system = list(range(8))
    a = [*system, 100, 101, 102, 103, 104]  # 13 tokens: 3 full blocks + 1
    b = [*system, 200, 201, 202, 203]  # 12 tokens: 3 full blocks
    ra = rec.add(5.0, hash_blocks(a, 4), len(a), 3, tenant="acme")
    rb = rec.add(7.5, hash_blocks(b, 4), len(b), 1, breakpoints=[TraceBreakpoint(12, "5m")])
    ra2 = rec.add(9.0, hash_blocks(a, 4), len(a), 3, tail_key=b"same-tail")
    ra3 = rec.add(9.5, hash_blocks(a, 4), len(a), 3, tail_key=b"same-tail")
    assert ra.hash_ids[:2] == rb.hash_ids[:2]  # the shared system prompt
    assert ra.hash_ids[2] != rb.hash_ids[2]
    assert ra2.hash_ids[:3] == ra.hash_ids[:3]
    assert ra.hash_ids[3] != ra2.hash_ids[3]  # a tail without a key is never shared
    assert ra2.hash_ids == ra3.hash_ids
    trace = rec.trace()
    assert [r.arrival_s for r in trace.requests] == [0.0, 2.5, 4.0, 4.5]
    assert parse_trace(dump_trace(trace)).requests == trace.requests
    with pytest.raises(ValueError, match="full blocks"):
        rec.add(1.0, hash_blocks(a, 4)[:1], len(a), 0)
