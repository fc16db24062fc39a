"""OpenAI's Chat Completions and (legacy) Completions requests, as the official `openai`
SDK sends them, and the parts of the answers this gateway builds.

Unknown fields are refused, as OpenAI does ("Unrecognized request argument supplied"):
a typo is a 400 naming it, never a parameter silently ignored. Fields this gateway
takes but cannot honour yet are refused by name with the reason (`gateway/contract/
openai.py`), not dropped. Lone surrogates are refused as on the Messages API.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)

from cachepoint.gateway.schemas.messages import reject_lone_surrogates
from cachepoint.protocol import SEED_MAX, SEED_MIN


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """A part whose shape OpenAI extends often: unknown keys are kept, not refused."""

    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------- content parts


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImageUrl(_Open):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Open):
    type: Literal["image_url"]
    image_url: ImageUrl


class RefusalPart(_Open):
    type: Literal["refusal"]
    refusal: str


class OtherPart(_Open):
    """Audio and files: parsed so the refusal can name them (contract/openai.py)."""

    type: Literal["input_audio", "file"]


ContentPart = Annotated[TextPart | ImagePart | RefusalPart | OtherPart, Field(discriminator="type")]


class FunctionCall(_Open):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Open):
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


# ---------------------------------------------------------------- messages


class _Message(_Open):
    name: str | None = None  # a participant name: accepted; the template has no place for it


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: str | list[TextPart]


class UserMessage(_Message):
    role: Literal["user"]
    content: str | list[ContentPart]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[TextPart | RefusalPart] | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextPart]


class FunctionMessage(_Message):
    """The deprecated `function` role: parsed so that its refusal is clear."""

    role: Literal["function"]
    content: str | None = None


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
    Field(discriminator="role"),
]


# ---------------------------------------------------------------- tools


class FunctionDef(_Open):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None  # no obfuscation here: accepted, no-op


# ---------------------------------------------------------------- requests


class _Sampling(_Model):
    """What both OpenAI endpoints share."""

    _unicode_only = model_validator(mode="before")(reject_lone_surrogates)

    model: str = Field(min_length=1, max_length=256)
    # OpenAI's ranges: temperature 0-2 (Anthropic's is 0-1); strict, so `true` is not 1.
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: StrictInt | None = Field(None, ge=1, le=128)
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=512)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # OpenAI's prompt caching: a routing key (never wider than the org) and a retention
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=64)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = Field(None, max_length=512)
    # vLLM's sampling extensions, which vLLM's clients and `vllm bench serve` send: a team
    # moving from vLLM keeps them (top_k, ignore_eos); the neutral values of the others
    top_k: StrictInt | None = Field(None, ge=-1)  # -1 or 0: off
    ignore_eos: StrictBool | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: str | None = None
    functions: Any = None
    function_call: Any = None


class CompletionRequest(_Sampling):
    """The legacy text completion: the prompt is continued as it is, no chat template."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: StrictInt | None = Field(16, ge=1)  # OpenAI's default for this endpoint
    echo: StrictBool | None = None
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: str | None = None


# ---------------------------------------------------------------- answers


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    audio_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = Field(
        default_factory=CompletionTokensDetails
    )
