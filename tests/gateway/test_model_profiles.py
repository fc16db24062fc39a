"""Per-model settings: each model id's context window, minimum cacheable
length and stop ids, over a live gateway and a real tiny replica where a reply counts."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from cachepoint.gateway.cli import parse
from cachepoint.gateway.contract.breakpoints import ScopePolicy
from cachepoint.gateway.contract.template import build_renderer
from cachepoint.gateway.pipeline import prepare
from cachepoint.gateway.profiles import ModelProfile, profile_of
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.gateway.tenancy.tenants import KeyContext

TINY, WIDE = "cachepoint-tiny", "wide-model"
# TINY: a short window, caches from 64 tokens, stops on two ids. WIDE: the gateway-wide
# window (4096), caches only from 1000 tokens.
PROFILES = {
    TINY: {"context_window": 256, "min_cacheable_tokens": 64, "stop_token_ids": [10, 46]},
    WIDE: {"min_cacheable_tokens": 1000},
}
CTX = KeyContext("k", "org1", None, False, ScopePolicy())


def _settings(**kw: object) -> GatewaySettings:
    return GatewaySettings(
        models=[TINY, WIDE], max_context_tokens=4096, model_profiles=PROFILES, **kw
    )


def _body(model: str, n_chars: int, cached: bool = False) -> dict:
    block: dict = {"type": "text", "text": "x" * n_chars}
    if cached:
        block["cache_control"] = {"type": "ephemeral"}
    return {
        "model": model,
        "max_tokens": 1,
        "temperature": 0,
        "messages": [{"role": "user", "content": [block]}],
    }


def test_profiles_take_unset_fields_from_the_gateway_wide_settings() -> None:
    s = _settings(min_cacheable_tokens=32)
    assert profile_of(s, TINY) == ModelProfile(256, 64, (10, 46))
    assert profile_of(s, WIDE) == ModelProfile(4096, 1000, ())
    # A model a replica reports but no profile names: the gateway-wide values.
    assert profile_of(s, "other") == ModelProfile(4096, 32, ())


def test_a_profile_of_a_model_not_served_is_a_startup_error(capsys) -> None:
    with pytest.raises(ValidationError, match=r"model_profiles names 'nope', not served here"):
        GatewaySettings(models=[TINY], model_profiles={"nope": {"context_window": 64}})
    with pytest.raises(ValidationError, match="context_window"):
        GatewaySettings(models=[TINY], model_profiles={TINY: {"context_window": 1}})
    with pytest.raises(ValidationError, match="stop_token_ids"):
        GatewaySettings(models=[TINY], model_profiles={TINY: {"stop_token_ids": [-2]}})
    with pytest.raises(ValidationError, match="windw"):
        GatewaySettings(models=[TINY], model_profiles={TINY: {"windw": 64}})
    with pytest.raises(SystemExit):
        parse(["--model-profile", "nope:context_window=64"])
    assert "model_profiles names 'nope', not served here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--model-profile", f"{TINY}:window=64"])
    assert "unknown key 'window'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--model-profile", "no-colon=64"])
    assert "expected MODEL:KEY=VALUE" in capsys.readouterr().err


def test_profiles_from_flags_and_from_the_environment(monkeypatch) -> None:
    _, s = parse(
        [
            "--model", TINY, "--model", "llama3:8b",
            "--model-profile", "llama3:8b:context_window=8192",
            "--model-profile", f"{TINY}:stop_token_ids=2, 7",
            "--model-profile", f"{TINY}:min-cacheable-tokens=0",
        ]
    )  # fmt: skip
    assert profile_of(s, "llama3:8b").context_window == 8192
    assert profile_of(s, TINY).stop_token_ids == (2, 7)
    assert profile_of(s, TINY).min_cacheable_tokens == 0
    monkeypatch.setenv("CACHEPOINT_GATEWAY_MODELS", json.dumps([TINY, WIDE]))
    monkeypatch.setenv("CACHEPOINT_GATEWAY_MODEL_PROFILES", json.dumps(PROFILES))
    assert profile_of(GatewaySettings(), TINY) == ModelProfile(256, 64, (10, 46))


def test_the_replica_payload_carries_the_models_stop_ids() -> None:
    s, renderer = _settings(), build_renderer(None)
    kw = {"ctx": CTX, "betas": set(), "settings": s, "renderer": renderer}
    tiny = prepare(MessagesRequest(**_body(TINY, 10)), **kw, request_id="req_1")
    wide = prepare(MessagesRequest(**_body(WIDE, 10)), **kw, request_id="req_2")
    assert tiny.payload.stop_token_ids == [10, 46]
    assert wide.payload.stop_token_ids == []


@pytest.fixture
def gateway(seeded_db, serve, tiny_engine):
    from cachepoint.engine import Engine, EngineConfig, ModelConfig
    from cachepoint.gateway.app import create_app
    from cachepoint.replica.api.app import create_app as create_replica_app
    from cachepoint.replica.settings import ReplicaSettings

    db, keys = seeded_db
    # NOTE: one replica per model: the gateway routes a model only to replicas serving it.
    tiny = serve(create_replica_app(ReplicaSettings(name="r0", model_name=TINY), tiny_engine))
    wide_engine = Engine(
        ModelConfig.tiny(), EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=4096)
    )
    wide = serve(create_replica_app(ReplicaSettings(name="r1", model_name=WIDE), wide_engine))
    url = serve(create_app(_settings(database_url=db, replica_urls=[tiny, wide])))
    return url, {"x-api-key": keys["a"]}


def test_each_model_has_its_own_window_and_min_cacheable_length(gateway) -> None:
    url, headers = gateway

    def post(body: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=60)

    # ~400 tokens: within WIDE's 4096 window, past TINY's 256.
    assert post(_body(WIDE, 400)).status_code == 200
    r = post(_body(TINY, 400))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert " + 1 > 256, decrease input length" in err["message"]  # TINY's own window

    # ~150 tokens with a breakpoint: past TINY's 64-token minimum, short of WIDE's 1000.
    tiny = post(_body(TINY, 150, cached=True))
    wide = post(_body(WIDE, 150, cached=True))
    assert tiny.status_code == wide.status_code == 200, (tiny.text, wide.text)
    assert tiny.json()["usage"]["cache_creation_input_tokens"] > 0
    assert tiny.json()["usage"]["cache_creation"]["ephemeral_5m_input_tokens"] > 0
    assert wide.json()["usage"]["cache_creation_input_tokens"] == 0
    # count_tokens plans the cache under the same profile, and counts the same prompt.
    usage = tiny.json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_creation_input_tokens"]
    for model in (TINY, WIDE):
        body = {k: v for k, v in _body(model, 150, True).items() if k in ("model", "messages")}
        counted = httpx.post(f"{url}/v1/messages/count_tokens", json=body, headers=headers)
        assert counted.status_code == 200, counted.text
        assert counted.json()["input_tokens"] == prompt


def test_models_report_each_models_own_window(gateway) -> None:
    url, headers = gateway
    listed = httpx.get(f"{url}/v1/models", headers=headers).json()["data"]
    windows = {m["id"]: m["max_input_tokens"] for m in listed}
    assert windows == {TINY: 256, WIDE: 4096}
    one = httpx.get(f"{url}/v1/models/{TINY}", headers=headers).json()
    assert (one["max_input_tokens"], one["max_tokens"]) == (256, 255)
