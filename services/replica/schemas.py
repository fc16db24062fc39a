"""The replica's own admin API (``POST /v1/drain``, which the pod's preStop hook calls).

The gateway <-> replica wire schema (generate request, events, final response,
``/v1/stats``) is cachepoint.protocol, which both sides import.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# NOTE: an hour: longer than any pod's termination grace, so a typo (seconds read as
# milliseconds) is refused rather than holding a preStop hook for days.
MAX_DRAIN_S = 3600.0


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(
        ge=0,
        le=MAX_DRAIN_S,
        description="how long to wait for the requests in flight (streams included) to end",
    )


class DrainResponse(BaseModel):
    drained: bool  # nothing was in flight when the answer was sent
    in_flight: int  # generate calls still running (0 when drained)
