"""Prometheus metrics of the gateway, in a registry of its own (one per app)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .contract.billing import Buckets

_FAST = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _PlaneCollector(Collector):
    """Event-plane figures read at scrape time from the directory and the bus."""

    def __init__(self, read: Callable[[], dict[str, float]]) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        v = self.read()
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

    def watch_plane(self, read: Callable[[], dict[str, float]]) -> None:
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
