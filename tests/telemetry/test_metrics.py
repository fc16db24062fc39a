"""/metrics on the gateway (its private listener) and the replica: parseable, and
moving by exactly a request."""

from __future__ import annotations

import anthropic
import httpx
from prometheus_client.parser import text_string_to_metric_families

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.gateway.app import create_app
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.replica.api.app import create_app as create_replica_app
from cachepoint.replica.settings import ReplicaSettings


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(snap, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, lab), v in snap.items()
        if n == name and all(dict(lab).get(k) == x for k, x in labels.items())
    )


def test_metrics_move_by_exactly_one_request(serve, seeded_db):
    engine = Engine(ModelConfig.tiny(), EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=2048))
    replica = serve(create_replica_app(ReplicaSettings(name="r0"), engine))
    db, keys = seeded_db
    app = create_app(
        GatewaySettings(
            database_url=db, replica_urls=[replica], min_cacheable_tokens=32, metrics_port=0
        )
    )
    url = serve(app)
    gw = app.state.metrics_url
    client = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    body = dict(
        model="cachepoint-tiny",
        max_tokens=3,
        system=[
            {
                "type": "text",
                "text": "Metrics are counted exactly. " * 6,
                "cache_control": {"type": "ephemeral"},
            }
        ],
        messages=[{"role": "user", "content": "count"}],
    )
    client.messages.create(**body)  # warm: the second call reads what this one wrote
    g0, r0 = samples(gw), samples(replica)
    msg = client.messages.create(**body)
    g1, r1 = samples(gw), samples(replica)
    u = msg.usage

    def moved(name: str, **labels: str) -> float:
        return total(g1, name, **labels) - total(g0, name, **labels)

    assert moved("cachepoint_billed_tokens_total", bucket="cache_read") == u.cache_read_input_tokens
    assert moved("cachepoint_billed_tokens_total", bucket="input") == u.input_tokens
    assert moved("cachepoint_billed_tokens_total", bucket="output") == u.output_tokens
    assert moved("cachepoint_billed_tokens_total", bucket="cache_write_5m") == (
        u.cache_creation.ephemeral_5m_input_tokens
    )
    assert moved("cachepoint_gateway_overhead_seconds_count") == 1
    assert moved("cachepoint_route_decisions_total", outcome="routed") == 1
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert (
        total(r1, "cachepoint_prefix_cache_query_tokens_total")
        - total(r0, "cachepoint_prefix_cache_query_tokens_total")
    ) == prompt
    hits = total(r1, "cachepoint_prefix_cache_hit_tokens_total") - total(
        r0, "cachepoint_prefix_cache_hit_tokens_total"
    )
    assert hits >= u.cache_read_input_tokens - 16  # engine hits cover the billed read (full blocks)
    assert total(r1, "cachepoint_kv_blocks", state="retained") > 0
    assert total(g1, "cachepoint_replicas_live") == 1


def test_metrics_count_a_streamed_request(serve, seeded_db):
    engine = Engine(ModelConfig.tiny(), EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=2048))
    replica = serve(create_replica_app(ReplicaSettings(name="r0"), engine))
    db, keys = seeded_db
    app = create_app(GatewaySettings(database_url=db, replica_urls=[replica], metrics_port=0))
    url = serve(app)
    gw = app.state.metrics_url
    client = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    g0 = samples(gw)
    with client.messages.stream(
        model="cachepoint-tiny", max_tokens=4, messages=[{"role": "user", "content": "stream"}]
    ) as stream:
        msg = stream.get_final_message()
    g1 = samples(gw)

    def moved(name: str, **labels: str) -> float:
        return total(g1, name, **labels) - total(g0, name, **labels)

    assert moved("cachepoint_billed_tokens_total", bucket="output") == msg.usage.output_tokens
    assert moved("cachepoint_gateway_requests_total", outcome="ok") == 1
    assert moved("cachepoint_gateway_overhead_seconds_count") == 1
    assert moved("cachepoint_gateway_upstream_seconds_count") == 1
    # A stream splits its time into the wait on the replica and the gateway's own share.
    overhead = moved("cachepoint_gateway_overhead_seconds_sum")
    upstream = moved("cachepoint_gateway_upstream_seconds_sum")
    assert overhead > 0
    assert upstream > 0


def test_gateway_metrics_are_not_on_the_public_port(serve, seeded_db):
    """The billed counters carry org ids: the API port must not serve them to anyone;
    the private listener does, and only it."""
    db, keys = seeded_db
    app = create_app(GatewaySettings(database_url=db, metrics_port=0))
    url = serve(app)
    assert httpx.get(f"{url}/metrics").status_code == 404
    assert httpx.get(f"{url}/metrics", headers={"x-api-key": keys["a"]}).status_code == 404
    private = httpx.get(f"{app.state.metrics_url}/metrics")
    assert private.status_code == 200
    assert "cachepoint_replicas_live" in private.text
