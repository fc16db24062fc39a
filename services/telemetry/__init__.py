"""Tracing set-up shared by every service: one TracerProvider per service, OTLP or a
local span file, FastAPI and httpx instrumented through their OpenTelemetry packages."""

from cachepoint.telemetry.provider import Telemetry, TelemetrySettings, configure, disabled
from cachepoint.telemetry.server import UNTRACED_PATHS, instrument_server

__all__ = [
    "UNTRACED_PATHS",
    "Telemetry",
    "TelemetrySettings",
    "configure",
    "disabled",
    "instrument_server",
]
