"""The generate request: what the gateway sends to ``POST /v1/generate``.

Validated by the replica (FastAPI); built by the gateway from its cache plan. The
cache limits are kvcore's, so the two cannot drift; the rest are the API's own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cachepoint.kvcore import MAX_LOOKBACK_BOUNDARIES
from cachepoint.kvcore.limits import MAX_BREAKPOINTS, MAX_EXTRA_KEYS, MAX_KEY_SPANS

SEED_MIN = -(2**63)  # a sampling seed's range: a signed 64-bit integer
SEED_MAX = 2**63 - 1

# NOTE: "24h" is OpenAI's extended retention (prompt_cache_retention), which the
# gateway sends only for its OpenAI endpoints; the Messages API has 5m and 1h.
TtlLabel = Literal["5m", "1h", "24h"]

MAX_REQUEST_ID_CHARS = 128  # a request id is logged and traced: bounded
MAX_STOP_SEQUENCES = 16  # stop strings checked after every token
MAX_STOP_TOKEN_IDS = 16  # ids that end the turn like EOS
MAX_OWNER_CHARS = 128  # a retention owner is a label on metrics and quotas
# NOTE: a breakpoint looks back on MAX_LOOKBACK_BOUNDARIES content-block boundaries,
# itself included: the request carries the others.
MAX_BOUNDARIES = MAX_LOOKBACK_BOUNDARIES - 1
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # an int32, as vLLM's priority


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KeySpanIn(_Strict):
    """Extra keys from ``start_block`` on (contract §3: global prefix, then org blocks)."""

    start_block: int = Field(ge=0)
    extra_keys: list[str] = Field(max_length=MAX_EXTRA_KEYS)


class BreakpointIn(_Strict):
    """A `cache_control` marker, already resolved by the gateway to a token position."""

    position: int = Field(ge=1, description="prefix length in tokens the entry covers")
    ttl: TtlLabel = "5m"
    extra_keys: list[str] | None = Field(
        None, description="keys of the entry; default: the key span of its last block"
    )
    boundaries: list[int] = Field(
        default_factory=list,
        max_length=MAX_BOUNDARIES,
        description="earlier content-block ends to look back on, nearest first",
    )


class GenerateRequest(_Strict):
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)
    token_ids: Annotated[list[int], Field(min_length=1)]
    key_spans: list[KeySpanIn] = Field(default_factory=list, max_length=MAX_KEY_SPANS)
    breakpoints: list[BreakpointIn] = Field(default_factory=list, max_length=MAX_BREAKPOINTS)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    stop_token_ids: list[int] = Field(
        default_factory=list,
        max_length=MAX_STOP_TOKEN_IDS,
        description="ids that end the turn like EOS (stop_reason end_turn), even with "
        "ignore_eos; checked against the vocabulary",
    )
    # NOTE: int64, OpenAI's range and one that every engine's generator takes (torch's
    # manual_seed refused -2**63 - 1 with a 500).
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool = False
    stream: bool = False
    priority: int = Field(
        0,
        ge=PRIORITY_MIN,
        le=PRIORITY_MAX,
        strict=True,  # NOTE: a JSON `true`, "1" or 1.5 is not a priority
        description="scheduling priority: lower runs first (admission) and is preempted "
        "last when KV runs out; FIFO within a priority (as vLLM's priority scheduling)",
    )
    retention_owner: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_OWNER_CHARS,
        description="tenant charged for the blocks its entries retain (the gateway sends "
        "org:<id>); None = one shared owner for every request that names none",
    )
    owner_retained_share: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        strict=True,  # NOTE: a JSON `true` is not a share (ints still are)
        description="share of this replica's retained budget the owner may hold; "
        "None = the replica's org_retained_share",
    )

    @model_validator(mode="after")
    def _positions(self) -> GenerateRequest:
        n = len(self.token_ids)
        last = 0
        for i, bp in enumerate(sorted(self.breakpoints, key=lambda b: b.position)):
            if bp.position > n:
                raise ValueError(f"breakpoints.{i}.position {bp.position} is past the prompt ({n})")
            if bp.position == last:
                raise ValueError(f"breakpoints.{i}: two breakpoints at position {bp.position}")
            last = bp.position
            for b in bp.boundaries:
                if not 0 < b < bp.position:
                    raise ValueError(
                        f"breakpoints.{i}.boundaries: {b} must be within 1..{bp.position - 1}"
                    )
        starts = [s.start_block for s in self.key_spans]
        if starts and (starts[0] != 0 or starts != sorted(set(starts))):
            raise ValueError("key_spans must start at block 0 and strictly increase")
        return self


def _fields(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.__dict__  # NOTE: pydantic keeps a model's fields, and only them, here
    # NOTE: only our models reach here (msgspec encodes the built-in types itself), so
    # anything else is a bug in the caller: say which type.
    raise TypeError(f"cannot encode {type(obj).__name__} as part of a generate request")


# NOTE: msgspec writes a long token list several times faster than pydantic's own
# serializer (a 100k-token prompt: 0.4 ms against 1.5 ms); on the gateway that is most
# of its CPU time per request that is not rendering.
_REQUESTS = msgspec.json.Encoder(enc_hook=_fields)


def encode_request(request: GenerateRequest) -> bytes:
    """The request as the JSON body of ``POST /v1/generate`` (every field, defaults too)."""
    return _REQUESTS.encode(request)
