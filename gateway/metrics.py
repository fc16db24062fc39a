"""Prometheus metrics of the gateway, in a registry of its own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from .contract.billing import Buckets


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
            registry=self.registry,
        )

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
