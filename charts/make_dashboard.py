"""Writes charts/cachepoint/dashboards/cachepoint.json, the Grafana dashboard the chart
ships. Kept as code so panel queries follow the metric names in one reviewable place;
tests/charts checks that every metric it queries is one the services export.

Run: .venv/bin/python charts/make_dashboard.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).parent / "cachepoint" / "dashboards" / "cachepoint.json"

PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    # (title, unit, [(promql, legend)])
    (
        "Prefix-cache hit rate (engine, tokens)",
        "percentunit",
        [
            (
                "sum(rate(cachepoint_prefix_cache_hit_tokens_total[5m])) / "
                "sum(rate(cachepoint_prefix_cache_query_tokens_total[5m]))",
                "hit rate",
            ),
        ],
    ),
    (
        "Engine hits vs billed cache reads (tokens/s)",
        "short",
        [
            ("sum(rate(cachepoint_prefix_cache_hit_tokens_total[5m]))", "engine hits"),
            ('sum(rate(cachepoint_billed_tokens_total{bucket="cache_read"}[5m]))', "billed reads"),
        ],
    ),
    (
        "KV blocks by state",
        "short",
        [
            ("sum by (state) (cachepoint_kv_blocks)", "{{state}}"),
        ],
    ),
    (
        "Retention refusals and evictions (/s)",
        "short",
        [
            ("sum(rate(cachepoint_retention_refusals_total[5m]))", "retention refused"),
            ("sum(rate(cachepoint_kv_evicted_blocks_total[5m]))", "blocks evicted"),
        ],
    ),
    (
        "TTFT at the replica",
        "s",
        [
            (
                "histogram_quantile(0.5, sum by (le) (rate(cachepoint_ttft_seconds_bucket[5m])))",
                "p50",
            ),
            (
                "histogram_quantile(0.9, sum by (le) (rate(cachepoint_ttft_seconds_bucket[5m])))",
                "p90",
            ),
        ],
    ),
    (
        "Prefill and decode seconds (p90)",
        "s",
        [
            (
                "histogram_quantile(0.9, sum by (le) "
                "(rate(cachepoint_prefill_seconds_bucket[5m])))",
                "prefill",
            ),
            (
                "histogram_quantile(0.9, sum by (le) (rate(cachepoint_decode_seconds_bucket[5m])))",
                "decode",
            ),
        ],
    ),
    (
        "Gateway overhead",
        "s",
        [
            (
                "histogram_quantile(0.5, sum by (le) "
                "(rate(cachepoint_gateway_overhead_seconds_bucket[5m])))",
                "p50",
            ),
            (
                "histogram_quantile(0.99, sum by (le) "
                "(rate(cachepoint_gateway_overhead_seconds_bucket[5m])))",
                "p99",
            ),
        ],
    ),
    (
        "Billed tokens by bucket (/s)",
        "short",
        [
            ("sum by (bucket) (rate(cachepoint_billed_tokens_total[5m]))", "{{bucket}}"),
        ],
    ),
    (
        "Cost by org and model (USD/h)",
        "currencyUSD",
        [
            (
                "sum by (org, model) (rate(cachepoint_billed_cost_usd_total[1h])) * 3600",
                "{{org}} {{model}}",
            ),
        ],
    ),
    (
        "Route decisions (/s)",
        "short",
        [
            (
                "sum by (policy, outcome) (rate(cachepoint_route_decisions_total[5m]))",
                "{{policy}} {{outcome}}",
            ),
        ],
    ),
    (
        "Event plane",
        "short",
        [
            ("max(cachepoint_event_lag_seconds)", "event lag (s)"),
            ("sum(increase(cachepoint_index_resyncs_total[5m]))", "resyncs / 5m"),
            ("sum(increase(cachepoint_heartbeat_misses_total[5m]))", "heartbeat misses / 5m"),
            ("max(cachepoint_replicas_live)", "replicas live"),
        ],
    ),
    (
        "Requests by outcome (/s)",
        "short",
        [
            (
                "sum by (outcome) (rate(cachepoint_gateway_requests_total[5m]))",
                "gateway {{outcome}}",
            ),
            (
                "sum by (outcome) (rate(cachepoint_replica_requests_total[5m]))",
                "replica {{outcome}}",
            ),
        ],
    ),
]


def build() -> dict[str, object]:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [
                    {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend}
                    for j, (expr, legend) in enumerate(targets)
                ],
            }
        )
    return {
        "title": "Cachepoint",
        "uid": "cachepoint-overview",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "tags": ["cachepoint", "llm", "kv-cache"],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Prometheus",
                }
            ]
        },
        "panels": panels,
    }


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}")
