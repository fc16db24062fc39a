"""Server-side instrumentation shared by the gateway and the replica."""

from __future__ import annotations

from typing import Any

from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

from cachepoint.telemetry.provider import Telemetry

UNTRACED_PATHS = "/healthz,/readyz,/metrics,/v1/stats"
"""Probes, scrapes and the gateway's load polls, which the server instrumentations skip:
a trace per kubelet probe or Prometheus scrape would bury the requests in `cachepoint
traces` and in the collector."""


def instrument_server(app: Any, tel: Telemetry) -> None:
    """Give every request to ``app`` a server span (nothing when tracing is off).

    NOTE: the ASGI "receive"/"send" child spans only repeat the server span's timing;
    dropping them keeps a request's waterfall readable.
    """
    if tel.enabled:
        FastAPIInstrumentor.instrument_app(
            app,
            tracer_provider=tel.provider,
            exclude_spans=["receive", "send"],
            excluded_urls=UNTRACED_PATHS,
        )
