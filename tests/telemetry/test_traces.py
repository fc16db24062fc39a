"""One request, one trace: gateway -> route -> replica -> admit/prefill/publish/decode -> bill."""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cachepoint.engine import Engine, EngineConfig, ModelConfig
from cachepoint.gateway.app import create_app
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.replica.api.app import create_app as create_replica_app
from cachepoint.replica.settings import ReplicaSettings
from cachepoint.telemetry import TelemetrySettings, configure

SYSTEM = "You are a patient tutor for chemistry students. " * 10


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out: {what}"
        time.sleep(0.05)


@pytest.fixture
def traced(serve, free_port, nats_server, seeded_db):
    exporter = InMemorySpanExporter()
    port = free_port()
    engine = Engine(ModelConfig.tiny(), EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=2048))
    replica = serve(
        create_replica_app(
            ReplicaSettings(
                name="r0",
                port=port,
                nats_url=nats_server.url,
                heartbeat_interval_s=0.2,
                advertise_url=f"http://127.0.0.1:{port}",
            ),
            engine,
            telemetry=configure("cachepoint-replica", exporter=exporter),
        ),
        port,
    )
    db, keys = seeded_db
    app = create_app(
        GatewaySettings(
            database_url=db,
            nats_url=nats_server.url,
            replica_urls=[replica],
            heartbeat_interval_s=0.2,
            min_cacheable_tokens=64,
        ),
        telemetry=configure("cachepoint-gateway", exporter=exporter),
    )
    url = serve(app)
    _wait(lambda: app.state.bus.connected, "NATS")
    client = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    return client, exporter


def ask(client, user: str):
    raw = client.messages.with_raw_response.create(
        model="cachepoint-tiny",
        max_tokens=3,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": user}],
    )
    return raw.headers["request-id"], raw.parse()


def trace_of(exporter, request_id: str):
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.attributes.get("cachepoint.request_id") == request_id)
    tid = root.context.trace_id
    return root, [s for s in spans if s.context.trace_id == tid]


def children(spans, parent):
    return {
        s.name: s
        for s in spans
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    }


def test_traces_one_request_one_connected_trace(traced):
    client, exporter = traced
    rid, msg = ask(client, "What is a mole?")
    _wait(lambda: any(s.name == "bill" for s in exporter.get_finished_spans()), "spans")
    root, spans = trace_of(exporter, rid)
    assert root.name == "POST /v1/messages"
    top = children(spans, root)
    assert {"render", "route", "bill", "POST"} <= set(top)
    replica_server = children(spans, top["POST"])["POST /v1/generate"]
    inner = children(spans, replica_server)
    assert {"admit", "prefill", "publish", "decode"} <= set(inner)
    producer = children(spans, inner["publish"])
    assert any(
        name.endswith(" publish") and s.kind.name == "PRODUCER" for name, s in producer.items()
    )
    # Order in time: route before the hop, admit before prefill before decode, bill last.
    assert top["route"].end_time <= top["POST"].start_time
    assert inner["admit"].end_time <= inner["prefill"].end_time <= inner["decode"].end_time
    assert top["bill"].start_time >= top["POST"].end_time
    # The token attributes equal the usage the client got.
    u = msg.usage
    a = root.attributes
    assert a["gen_ai.request.model"] == "cachepoint-tiny"
    assert a["gen_ai.usage.output_tokens"] == u.output_tokens
    assert a["gen_ai.usage.cache_read.input_tokens"] == u.cache_read_input_tokens
    assert a["gen_ai.usage.cache_creation.input_tokens"] == u.cache_creation_input_tokens
    assert a["cachepoint.usage.input_tokens"] == u.input_tokens
    assert a["gen_ai.usage.input_tokens"] == (
        u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    )
    assert top["route"].attributes["cachepoint.route.replica"] == "r0"
    assert inner["prefill"].attributes["cachepoint.prefill.device"] == "cpu"


def test_traces_second_turn_computes_less(traced):
    client, exporter = traced
    rid1, _ = ask(client, "First question about moles")
    _wait(lambda: any(s.name == "bill" for s in exporter.get_finished_spans()), "first trace")
    rid2, msg2 = ask(client, "Second question about gases")
    assert msg2.usage.cache_read_input_tokens > 0
    _wait(lambda: sum(s.name == "bill" for s in exporter.get_finished_spans()) >= 2, "second trace")

    def computed(rid: str) -> int:
        _, spans = trace_of(exporter, rid)
        prefill = next(s for s in spans if s.name == "prefill")
        return prefill.attributes["cachepoint.prefill.computed_tokens"]

    assert computed(rid2) < computed(rid1)


def test_traces_context_crosses_nats(traced):
    client, exporter = traced
    ask(client, "Anything at all")

    def linked():
        spans = exporter.get_finished_spans()
        producers = {s.context.span_id for s in spans if s.kind.name == "PRODUCER"}
        return [
            s
            for s in spans
            if s.kind.name == "CONSUMER"
            and any(link.context.span_id in producers for link in s.links)
        ]

    _wait(lambda: bool(linked()), "a consumer span linked to a producer span")
    consumer = linked()[0]
    assert consumer.attributes["messaging.system"] == "nats"


def test_traces_skip_probes_and_scrapes(traced):
    client, exporter = traced
    gateway = str(client.base_url).rstrip("/")
    # /metrics has its own listener (metrics_port), outside the traced app.
    for path in ("/healthz", "/readyz"):
        assert httpx.get(f"{gateway}{path}").status_code == 200
    ask(client, "After the probes")
    _wait(lambda: any(s.name == "bill" for s in exporter.get_finished_spans()), "spans")
    servers = [s.name for s in exporter.get_finished_spans() if s.kind.name == "SERVER"]
    assert "POST /v1/messages" in servers
    assert not [n for n in servers if n.startswith("GET /")], servers


def test_traces_off_exports_nothing(serve, seeded_db):
    exporter = InMemorySpanExporter()
    off = TelemetrySettings(enabled=False)
    engine = Engine(ModelConfig.tiny(), EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=2048))
    replica = serve(
        create_replica_app(
            ReplicaSettings(name="r0"), engine, telemetry=configure("r", off, exporter=exporter)
        )
    )
    db, keys = seeded_db
    url = serve(
        create_app(
            GatewaySettings(database_url=db, replica_urls=[replica]),
            telemetry=configure("g", off, exporter=exporter),
        )
    )
    client = anthropic.Anthropic(base_url=url, api_key=keys["a"], max_retries=0)
    _, msg = ask(client, "hello")
    assert msg.usage.output_tokens >= 1
    assert exporter.get_finished_spans() == ()
