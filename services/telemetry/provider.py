"""Configure tracing for one service.

One `TracerProvider` per service object (not the process-global one), so a test can
run a gateway and a replica in one process with separate resources, and switching
tracing off really means no spans exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cachepoint.telemetry.spanfile import JsonLinesSpanExporter

VERSION = "0.1.0"
Exporter = Literal["auto", "otlp-grpc", "otlp-http", "file", "none"]


class TelemetrySettings(BaseSettings):
    """CACHEPOINT_TELEMETRY_* (plus the standard OTEL_EXPORTER_OTLP_ENDPOINT)."""

    model_config = SettingsConfigDict(env_prefix="CACHEPOINT_TELEMETRY_", extra="ignore")

    enabled: bool = Field(True, description="false: no spans are created or exported")
    exporter: Exporter = Field(
        "auto", description="auto: OTLP if an endpoint is set, else a span file if a folder is"
    )
    otlp_endpoint: str | None = Field(None, description="default: OTEL_EXPORTER_OTLP_ENDPOINT")
    traces_dir: Path | None = Field(None, description="span files for `cachepoint traces`")
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0, description="root spans kept")


@dataclass(slots=True)
class Telemetry:
    """A service's tracing: pass ``provider`` to instrumentations, use ``tracer``."""

    provider: TracerProvider | None  # None when tracing is off
    tracer: trace.Tracer
    processors: list[SpanProcessor] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def disabled() -> Telemetry:
    return Telemetry(None, trace.NoOpTracer())


def _otlp(kind: str, endpoint: str | None) -> SpanExporter:
    if kind == "otlp-http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )

    return GrpcExporter(endpoint=endpoint) if endpoint else GrpcExporter()


def configure(
    service: str,
    settings: TelemetrySettings | None = None,
    *,
    attributes: dict[str, Any] | None = None,
    exporter: SpanExporter | None = None,
) -> Telemetry:
    """Build the service's provider. ``exporter`` (e.g. an in-memory one in tests)
    overrides the settings' choice and exports synchronously."""
    import os

    settings = settings or TelemetrySettings()
    endpoint = settings.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    kind = settings.exporter
    if kind == "auto":
        kind = "otlp-grpc" if endpoint else ("file" if settings.traces_dir else "none")
    # NOTE: spans nobody exports are pure overhead on every request: no exporter, no tracing.
    if not settings.enabled or (kind == "none" and exporter is None):
        return disabled()
    resource = Resource.create(
        {"service.name": service, "service.version": VERSION, **(attributes or {})}
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio))
    )
    processors: list[SpanProcessor] = []
    if exporter is not None:
        processors.append(SimpleSpanProcessor(exporter))
    elif kind == "file":
        folder = settings.traces_dir or Path(".cachepoint/traces")
        processors.append(
            BatchSpanProcessor(JsonLinesSpanExporter(folder, service), schedule_delay_millis=1000)
        )
    elif kind in ("otlp-grpc", "otlp-http"):
        processors.append(BatchSpanProcessor(_otlp(kind, endpoint)))
    for p in processors:
        provider.add_span_processor(p)
    return Telemetry(provider, provider.get_tracer("cachepoint", VERSION), processors)
