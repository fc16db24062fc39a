"""Tracing set-up shared by every service: one TracerProvider per service, OTLP or a
local span file, FastAPI and httpx instrumented through their OpenTelemetry packages."""

from .provider import Telemetry, TelemetrySettings, configure, disabled

__all__ = ["Telemetry", "TelemetrySettings", "configure", "disabled"]
