"""Prometheus metrics of the gateway, in a registry of its own (one per app)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_wsgi_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cachepoint.billing import Buckets

_FAST = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _PlaneCollector(Collector):
    """Event-plane figures read at scrape time from the directory and the bus."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        # NOTE: scrapes run on the metrics listener's thread while the event loop may
        # be adding a replica: a dict that changed size mid-read is simply read again.
        for _ in range(3):
            try:
                v = self.read()
                break
            except RuntimeError:
                continue
        else:
            return
        yield GaugeMetricFamily(
            "cachepoint_event_lag_seconds",
            "Publish-to-apply delay of the last kv batch",
            value=v["lag_s"],
        )
        yield CounterMetricFamily(
            "cachepoint_index_resyncs", "Snapshot resyncs started", value=v["resyncs"]
        )
        yield CounterMetricFamily(
            "cachepoint_heartbeat_misses",
            "Replicas taken out of routing for silence",
            value=v["heartbeat_misses"],
        )
        yield GaugeMetricFamily(
            "cachepoint_replicas_live", "Replicas routing can use", value=v["live"]
        )
        yield CounterMetricFamily(
            "cachepoint_health_downs",
            "Replicas marked unhealthy by a failed health check",
            value=v.get("health_downs", 0),
        )
        refused = CounterMetricFamily(
            "cachepoint_event_rejections",
            "Event-plane messages refused, by reason (url, future_epoch, subject_mismatch)",
            labels=["reason"],
        )
        for reason, n in sorted(v.get("rejections", {}).items()):
            refused.add_metric([reason], n)
        yield refused


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.route_decisions = Counter(
            "cachepoint_route_decisions",
            "Routing decisions by policy and outcome",
            ["policy", "outcome"],
            registry=self.registry,
        )
        self.overhead = Histogram(
            "cachepoint_gateway_overhead_seconds",
            "Time a request spent in the gateway itself (total minus the replica call)",
            buckets=_FAST,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "cachepoint_gateway_ttft_seconds",
            "Time to first token seen by the gateway (streaming: message_start)",
            buckets=_SLOW,
            registry=self.registry,
        )
        self.billed_tokens = Counter(
            "cachepoint_billed_tokens",
            "Billed tokens by bucket",
            ["org", "model", "bucket"],
            registry=self.registry,
        )
        self.cost = Counter(
            "cachepoint_billed_cost_usd",
            "Billed cost in USD",
            ["org", "model"],
            registry=self.registry,
        )
        self.requests = Counter(
            "cachepoint_gateway_requests",
            "Messages requests by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.upstream_seconds = Histogram(
            "cachepoint_gateway_upstream_seconds",
            "Time spent waiting on the replica",
            buckets=_SLOW,
            registry=self.registry,
        )
        self.count_tokens = Counter(
            "cachepoint_gateway_count_tokens",
            "count_tokens requests by outcome (ok, invalid, rate_limited)",
            ["outcome"],
            registry=self.registry,
        )
        self.intake_seconds = Histogram(
            "cachepoint_gateway_intake_seconds",
            "Time in intake threads by step (messages: parse to plan; count_tokens_parse)",
            ["step"],
            buckets=_FAST + _SLOW[7:],
            registry=self.registry,
        )
        self.intake_refused = Counter(
            "cachepoint_gateway_intake_refused",
            "Requests refused because their org's intake share and queue were full",
            registry=self.registry,
        )
        # NOTE: no tenant label: the public metrics port must not list tenants.
        self.diagnoses = Counter(
            "cachepoint_gateway_cache_diagnoses",
            "Requests that asked for cache diagnostics, by cache_miss_reason type "
            "(none: a first turn, or nothing diverged)",
            ["reason"],
            registry=self.registry,
        )

    def watch_plane(self, read: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_PlaneCollector(read))

    def billed(self, org: str, model: str, b: Buckets, cost_micros: int) -> None:
        for bucket, n in (
            ("input", b.input_tokens),
            ("cache_read", b.cache_read_input_tokens),
            ("cache_write_5m", b.cache_write_5m_tokens),
            ("cache_write_1h", b.cache_write_1h_tokens),
            ("output", b.output_tokens),
        ):
            if n:
                self.billed_tokens.labels(org, model, bucket).inc(n)
        self.cost.labels(org, model).inc(cost_micros / 1_000_000)


@dataclass(slots=True)
class MetricsListener:
    """The private /metrics listener: prometheus_client's own threaded HTTP server on a
    port apart from the API, because the billed figures carry each org's id."""

    server: WSGIServer  # serves the registry on every path
    thread: threading.Thread  # the server's daemon thread
    host: str  # the address it is bound to

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def listen(registry: CollectorRegistry, host: str, port: int) -> MetricsListener:
    """Serve ``registry`` on ``host:port`` (0 = any free port) until ``close``."""
    server, thread = start_wsgi_server(port, addr=host, registry=registry)
    return MetricsListener(server, thread, host)
