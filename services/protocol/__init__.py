"""The gateway <-> replica wire protocol: the generate request, the NDJSON events of a
streamed generation, the final response, ``/v1/stats``, and the protocol's version.

Both sides build and read these types (the replica validates requests with them, the
gateway decodes events with them), so the schema lives once. It imports nothing of
ours but kvcore, whose limits the request's bounds are (an import-linter contract in
pyproject.toml).
"""

from cachepoint.protocol.events import (
    EVENT_TYPES,
    DoneEvent,
    ErrorDetail,
    ErrorEvent,
    Event,
    MalformedEvent,
    PrefillDoneEvent,
    TokenEvent,
    decode_event,
    encode_event,
    event_name,
)
from cachepoint.protocol.request import (
    SEED_MAX,
    SEED_MIN,
    BreakpointIn,
    GenerateRequest,
    KeySpanIn,
    TtlLabel,
    encode_request,
)
from cachepoint.protocol.response import (
    STOP_REASONS,
    CacheReport,
    GenerateResponse,
    RetentionMode,
    StopReason,
    Timings,
)
from cachepoint.protocol.stats import BlockStats, StatsResponse, TierStatsOut
from cachepoint.protocol.version import (
    PROTOCOL_VERSION,
    VERSION_HEADER,
    VERSION_MISMATCH_STATUS,
    version_mismatch,
)

__all__ = [
    "EVENT_TYPES",
    "PROTOCOL_VERSION",
    "SEED_MAX",
    "SEED_MIN",
    "STOP_REASONS",
    "VERSION_HEADER",
    "VERSION_MISMATCH_STATUS",
    "BlockStats",
    "BreakpointIn",
    "CacheReport",
    "DoneEvent",
    "ErrorDetail",
    "ErrorEvent",
    "Event",
    "GenerateRequest",
    "GenerateResponse",
    "KeySpanIn",
    "MalformedEvent",
    "PrefillDoneEvent",
    "RetentionMode",
    "StatsResponse",
    "StopReason",
    "TierStatsOut",
    "Timings",
    "TokenEvent",
    "TtlLabel",
    "decode_event",
    "encode_event",
    "encode_request",
    "event_name",
    "version_mismatch",
]
