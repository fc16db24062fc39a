"""Tracing set-up shared by every service: one TracerProvider per service, OTLP or a
local span file, FastAPI and httpx instrumented through their OpenTelemetry packages."""

from .provider import UNTRACED_PATHS, Telemetry, TelemetrySettings, configure, disabled

__all__ = ["UNTRACED_PATHS", "Telemetry", "TelemetrySettings", "configure", "disabled"]
