"""The replica's HTTP API, served by a real uvicorn on a free port."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachepoint.engine import Engine
from cachepoint.replica.api.app import create_app
from cachepoint.replica.settings import ReplicaSettings


@pytest.fixture
def base_url(engine: Engine, sink, serve) -> str:
    settings = ReplicaSettings(name="r-api", max_num_batched_tokens=256)
    return serve(create_app(settings, engine, sink=sink))


PROMPT = list(range(1, 101))


def test_api_generate_then_hit(base_url: str):
    body = {"token_ids": PROMPT, "max_tokens": 4, "breakpoints": [{"position": 90}]}
    r1 = httpx.post(f"{base_url}/v1/generate", json=body)
    assert r1.status_code == 200, r1.text
    r2 = httpx.post(f"{base_url}/v1/generate", json=body).json()
    assert r1.json()["cache"]["written_5m_tokens"] == 90
    assert r2["cache"]["entry_hit_tokens"] == 90
    assert r2["cache"]["engine_hit_tokens"] == 96
    assert r2["output_token_ids"] == r1.json()["output_token_ids"]
    stats = httpx.get(f"{base_url}/v1/stats").json()
    assert stats["entries"] == 1
    assert stats["hit_tokens"] == 96
    assert stats["blocks"]["active"] == 0
    assert stats["blocks"]["retained"] == 5  # 90 tokens -> 5 full blocks


def test_api_stream_matches_non_stream(base_url: str):
    body = {"token_ids": PROMPT, "max_tokens": 6, "ignore_eos": True}
    plain = httpx.post(f"{base_url}/v1/generate", json=body).json()
    with httpx.stream("POST", f"{base_url}/v1/generate", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[0]["type"] == "prefill_done"
    assert lines[-1]["type"] == "done"
    tokens = [x["token_id"] for x in lines if x["type"] == "token"]
    assert tokens == plain["output_token_ids"]
    assert lines[-1]["response"]["text"] == "".join(
        x["text"] for x in lines if x["type"] == "token"
    )


def test_api_stop_token_ids_end_the_turn_streamed_or_not(base_url: str):
    body = {"token_ids": PROMPT, "max_tokens": 12, "ignore_eos": True}
    free = httpx.post(f"{base_url}/v1/generate", json=body).json()["output_token_ids"]
    at = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    body = {**body, "stop_token_ids": [free[at]]}
    plain = httpx.post(f"{base_url}/v1/generate", json=body).json()
    assert plain["stop_reason"] == "end_turn"
    assert plain["output_token_ids"] == free[: at + 1]
    with httpx.stream("POST", f"{base_url}/v1/generate", json={**body, "stream": True}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [x["token_id"] for x in lines if x["type"] == "token"] == free[: at + 1]
    assert lines[-1]["response"]["stop_reason"] == "end_turn"


def test_api_health_and_metrics(base_url: str):
    assert httpx.get(f"{base_url}/healthz").status_code == 200
    assert httpx.get(f"{base_url}/readyz").json()["status"] == "ready"

    def queried() -> float:
        text = httpx.get(f"{base_url}/metrics").text
        for fam in text_string_to_metric_families(text):
            if fam.name == "cachepoint_prefix_cache_query_tokens":
                return sum(s.value for s in fam.samples if s.name.endswith("_total"))
        raise AssertionError("metric missing")

    before = queried()
    httpx.post(f"{base_url}/v1/generate", json={"token_ids": PROMPT[:37], "max_tokens": 1})
    assert queried() - before == 37


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"token_ids": [1, 99999]}, "token_ids.1: 99999 is not a token id"),
        ({"token_ids": [1, 2], "stop_token_ids": [5, 99999]}, "stop_token_ids.1: 99999 is not"),
        ({"token_ids": [1, 2], "stop_token_ids": [-1]}, "stop_token_ids.0: -1 is not"),
        ({"token_ids": [1, 2], "stop_token_ids": list(range(17))}, "stop_token_ids"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, 2], "bogus": 1}, "bogus"),
        ({"token_ids": [1, 2], "breakpoints": [{"position": 9}]}, "past the prompt"),
        ({"token_ids": [1, 2], "breakpoints": [{"position": 2, "ttl": "2h"}]}, "ttl"),
        ({"token_ids": [1] * 2048}, "max_model_len"),
        ({"token_ids": "abc"}, "token_ids"),
    ],
)
def test_api_bad_input_is_a_clear_400(base_url: str, body, message):
    r = httpx.post(f"{base_url}/v1/generate", json=body)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error"
    assert message in err["error"]["message"]


def test_api_malformed_json_is_400(base_url: str):
    r = httpx.post(
        f"{base_url}/v1/generate", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{base_url}/v2/nothing").json()["error"]["type"] == "not_found_error"


def test_api_client_disconnect_aborts(base_url: str):
    body = {"token_ids": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/generate", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 3:
                break  # leaving the block closes the connection mid-decode
    deadline = time.time() + 10
    while True:
        stats = httpx.get(f"{base_url}/v1/stats").json()
        if stats["running"] == 0 and stats["blocks"]["active"] == 0:
            break
        assert time.time() < deadline, f"request still running: {stats}"
        time.sleep(0.05)
