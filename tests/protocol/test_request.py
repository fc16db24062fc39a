"""cachepoint.protocol's generate request, final response and stats: round trips, the
gateway's unvalidated build encoding as a validated one, and limits that are kvcore's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from cachepoint.kvcore import MAX_LOOKBACK_BOUNDARIES
from cachepoint.kvcore.limits import MAX_BREAKPOINTS, MAX_EXTRA_KEYS, MAX_KEY_SPANS
from cachepoint.protocol import (
    BlockStats,
    BreakpointIn,
    GenerateRequest,
    KeySpanIn,
    StatsResponse,
    TierStatsOut,
    encode_request,
)

FIELDS = {
    "request_id": "req_1",
    "token_ids": list(range(200)),
    "key_spans": [{"start_block": 0, "extra_keys": ["g"]}, {"start_block": 2, "extra_keys": []}],
    "breakpoints": [
        {"position": 64, "ttl": "1h", "extra_keys": ["g"], "boundaries": [10, 20]},
        {"position": 150, "ttl": "5m", "extra_keys": None, "boundaries": []},
    ],
    "max_tokens": 32,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "stop_sequences": ["\n\n"],
    "stop_token_ids": [2],
    "seed": 7,
    "ignore_eos": True,
    "stream": True,
    "priority": -3,
    "retention_owner": "org:a",
    "owner_retained_share": 0.25,
}


def test_the_request_round_trips() -> None:
    request = GenerateRequest.model_validate(FIELDS)
    body = encode_request(request)
    assert json.loads(body) == FIELDS
    assert GenerateRequest.model_validate_json(body) == request


def test_the_gateways_unvalidated_build_encodes_as_a_validated_one() -> None:
    # The gateway builds with model_construct (pipeline.prepare): same bytes on the wire.
    nested = {
        "key_spans": [KeySpanIn.model_construct(**s) for s in FIELDS["key_spans"]],
        "breakpoints": [BreakpointIn.model_construct(**b) for b in FIELDS["breakpoints"]],
    }
    built = GenerateRequest.model_construct(**{**FIELDS, **nested})
    assert encode_request(built) == encode_request(GenerateRequest.model_validate(FIELDS))
    # Defaults are sent too, as a validated request has them.
    sparse = GenerateRequest.model_construct(token_ids=[1, 2])
    assert json.loads(encode_request(sparse)) == GenerateRequest(token_ids=[1, 2]).model_dump()


def _request(**extra: object) -> dict[str, object]:
    return {"token_ids": list(range(4096)), **extra}


@pytest.mark.parametrize(
    ("field", "at_limit", "over_limit"),
    [
        (
            "breakpoints",
            [{"position": 16 * (i + 1)} for i in range(MAX_BREAKPOINTS)],
            [{"position": 16 * (i + 1)} for i in range(MAX_BREAKPOINTS + 1)],
        ),
        (
            "key_spans",
            [{"start_block": i, "extra_keys": []} for i in range(MAX_KEY_SPANS)],
            [{"start_block": i, "extra_keys": []} for i in range(MAX_KEY_SPANS + 1)],
        ),
        (
            "key_spans",
            [{"start_block": 0, "extra_keys": ["k"] * MAX_EXTRA_KEYS}],
            [{"start_block": 0, "extra_keys": ["k"] * (MAX_EXTRA_KEYS + 1)}],
        ),
        (
            "breakpoints",
            [{"position": 4000, "boundaries": list(range(1, MAX_LOOKBACK_BOUNDARIES))}],
            [{"position": 4000, "boundaries": list(range(1, MAX_LOOKBACK_BOUNDARIES + 1))}],
        ),
        ("seed", -(2**63), -(2**63) - 1),
        ("seed", 2**63 - 1, 2**63),
    ],
    ids=["breakpoints", "key-spans", "extra-keys", "boundaries", "seed-min", "seed-max"],
)
def test_a_request_at_a_kvcore_limit_passes_and_one_past_it_is_refused(
    field: str, at_limit: object, over_limit: object
) -> None:
    GenerateRequest.model_validate(_request(**{field: at_limit}))
    with pytest.raises(ValidationError):
        GenerateRequest.model_validate(_request(**{field: over_limit}))


def test_stats_round_trip() -> None:
    tier = TierStatsOut(
        tier="host",
        slots=8,
        bytes=1024,
        used=3,
        visible=2,
        retained=1,
        max_retained=4,
        hit_blocks=5,
        promoted_blocks=4,
        demoted_blocks=6,
        evicted_blocks=2,
        dropped_blocks=1,
        failed_copies=0,
    )
    stats = StatsResponse(
        replica="r0",
        epoch=2,
        model="m",
        block_size=16,
        max_model_len=4096,
        blocks=BlockStats(total=64, active=4, cached_free=8, empty=52, retained=2, max_retained=8),
        entries=3,
        query_tokens=100,
        hit_tokens=64,
        hit_rate=0.64,
        evictions=1,
        retain_refusals=0,
        waiting=0,
        running=1,
        queued_prefill_tokens=12,
        max_waiting=256,
        tiers=[tier],
        draining=True,
        engine="vllm",
    )
    assert StatsResponse.model_validate_json(stats.model_dump_json(), strict=True) == stats


def test_the_protocol_loads_no_server_and_no_engine() -> None:
    code = (
        "import sys, cachepoint.protocol; "
        "bad = [m for m in ('torch', 'fastapi', 'httpx', 'cachepoint.gateway', "
        "'cachepoint.replica', 'cachepoint.engine') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
