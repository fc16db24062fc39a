"""OpenAI's Chat Completions request as the same request on the Messages pipeline, and
the pipeline's answer back in OpenAI's words.

Pure: a `ChatCompletionRequest` in, a `Translated` out (or a 400 naming the parameter
and why). Everything after this (rendering through the model's chat template, routing,
the replica protocol, tracing, the ledger) is the Messages path's own, unchanged.

What OpenAI's caching contract asks differs from Anthropic's, and is not expressed as
markers: a prompt of at least the model's minimum is cached automatically, what the
engine reused of it (whole blocks) is reported as ``cached_tokens`` and billed at the
cached-input price, and nothing is billed as a write (`gateway/pipeline.py`,
``implicit_min``). docs/openai.md maps every field.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from cachepoint.gateway.errors import ApiError, invalid
from cachepoint.gateway.schemas.messages import MessagesRequest
from cachepoint.gateway.schemas.openai import (
    AssistantMessage,
    ChatCompletionRequest,
    CompletionRequest,
    FunctionMessage,
    ImagePart,
    OtherPart,
    RefusalPart,
    SystemMessage,
    TextPart,
    ToolMessage,
    UserMessage,
)

FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}
FINISH_TOOLS = "tool_calls"


@dataclass(frozen=True, slots=True)
class Translated:
    """A Chat Completions request on the Messages pipeline."""

    body: MessagesRequest  # the same conversation, tools and limits, as a Messages request
    temperature: float | None  # OpenAI's 0-2 (Messages stops at 1): set on the payload
    seed: int | None  # set on the payload (the replica samples with it)
    top_k: int | None  # vLLM's extension (-1 or 0: off)
    ignore_eos: bool  # vLLM's extension: generate max_tokens whatever the model says
    clamp: bool  # no max tokens was sent: the answer may use what the window leaves
    include_usage: bool  # streaming: a last chunk with the usage
    cache_key: str | None  # prompt_cache_key: a routing key within the org, and the ledger's
    retain_24h: bool  # prompt_cache_retention "24h": the prompt kept as a 24h entry


def refuse(param: str, message: str) -> ApiError:
    """OpenAI's 400 for a parameter this gateway does not honour, naming it."""
    return invalid(message, param=param)


def unsupported(param: str, why: str) -> ApiError:
    return refuse(param, f"Unsupported parameter: '{param}' {why}")


def _common_refusals(req: ChatCompletionRequest | CompletionRequest) -> None:
    """What neither endpoint can honour yet: refused by name, never ignored."""
    if req.n is not None and req.n > 1:
        raise unsupported(
            "n", "greater than 1 is not supported here: send n requests (each is cached "
            "and billed on its own, and shares the prompt's cache with the others)"
        )  # fmt: skip
    if req.logit_bias:
        raise unsupported("logit_bias", "is not supported by this server's sampler")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise unsupported(name, "other than 0 is not supported by this server's sampler")
    if req.repetition_penalty not in (None, 1.0):
        raise unsupported("repetition_penalty", "other than 1 is not supported by this sampler")
    if req.min_p:
        raise unsupported("min_p", "other than 0 is not supported by this sampler")


def _chat_refusals(req: ChatCompletionRequest) -> None:
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise unsupported(
            "response_format", f"of type {fmt.get('type')!r} is not supported yet; only 'text' is"
        )
    if req.logprobs or req.top_logprobs:
        raise unsupported("logprobs", "is not supported by this server")
    if req.modalities not in (None, ["text"]):
        raise unsupported("modalities", "other than ['text'] is not supported with this model")
    for name in ("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity"):
        if getattr(req, name) is not None:
            raise unsupported(name, "is not supported with this model")
    if req.functions is not None or req.function_call is not None:
        name = "functions" if req.functions is not None else "function_call"
        raise unsupported(name, "is deprecated; use 'tools' and 'tool_choice'")


def _text(content: str | list[Any]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, TextPart))


def _image(part: ImagePart, where: str) -> dict[str, Any]:
    """An image part as the Messages API's image block (which the pipeline degrades as
    it degrades every image: the `cachepoint-degraded` header says so)."""
    url = part.image_url.url
    if not url.startswith("data:"):
        return {"type": "image", "source": {"type": "url", "url": url}}
    head, _, data = url.partition(",")
    media = head[5:].split(";")[0] or "image/png"
    if ";base64" not in head:
        raise refuse(where, "an image data URL must be base64 (data:image/png;base64,...)")
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise refuse(where, "an image data URL holds no valid base64") from None
    return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}


def _user_blocks(msg: UserMessage, i: int) -> list[dict[str, Any]]:
    if isinstance(msg.content, str):
        return [{"type": "text", "text": msg.content}]
    out: list[dict[str, Any]] = []
    for j, part in enumerate(msg.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(part, TextPart):
            out.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            out.append(_image(part, where))
        elif isinstance(part, OtherPart):
            raise refuse(where, f"content parts of type '{part.type}' are not supported here")
        elif isinstance(part, RefusalPart):
            raise refuse(where, "a 'refusal' part belongs to an assistant message")
    return out


def _assistant_blocks(msg: AssistantMessage, i: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text = _text(msg.content) if msg.content is not None else ""
    if text:
        out.append({"type": "text", "text": text})
    for j, call in enumerate(msg.tool_calls or []):
        where = f"messages[{i}].tool_calls[{j}].function.arguments"
        try:
            args = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError:
            raise refuse(where, "must be a JSON object (the arguments the model wrote)") from None
        if not isinstance(args, dict):
            raise refuse(where, "must be a JSON object (the arguments the model wrote)")
        out.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": args})
    return out


def _conversation(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]], list[dict]]:
    """(system blocks, messages) in the Messages API's shape. A tool result joins the
    user turn after the assistant's call, and consecutive user turns merge, as the
    Messages API wants tool results right after the call."""
    system: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    started = False
    for i, msg in enumerate(req.messages):
        if isinstance(msg, SystemMessage):
            if started:
                raise refuse(
                    f"messages[{i}]",
                    f"a '{msg.role}' message after the conversation started is not supported "
                    "here: put system and developer messages first",
                )
            text = _text(msg.content)
            if text:
                system.append({"type": "text", "text": text})
            continue
        started = True
        if isinstance(msg, FunctionMessage):
            raise refuse(f"messages[{i}].role", "the 'function' role is deprecated; use 'tool'")
        if isinstance(msg, AssistantMessage):
            blocks = _assistant_blocks(msg, i)
            if blocks:
                messages.append({"role": "assistant", "content": blocks})
            continue
        if isinstance(msg, ToolMessage):
            result = {"tool_use_id": msg.tool_call_id, "content": _text(msg.content)}
            blocks = [{"type": "tool_result", **result}]
        else:
            assert isinstance(msg, UserMessage)
            blocks = _user_blocks(msg, i)
        if messages and messages[-1]["role"] == "user":
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": "user", "content": blocks})
    if not messages:
        raise refuse("messages", "at least one user message is needed (system alone is not)")
    return system, messages


def _tool_choice(req: ChatCompletionRequest) -> dict[str, Any] | None:
    choice = req.tool_choice
    if choice is None:
        out = None
    elif choice == "none":
        out = {"type": "none"}
    elif choice == "auto":
        out = {"type": "auto"}
    elif choice == "required":
        out = {"type": "any"}
    else:
        out = {"type": "tool", "name": choice.function.name}
    if req.parallel_tool_calls is False and (out is None or out["type"] != "none"):
        out = {**(out or {"type": "auto"}), "disable_parallel_tool_use": True}
    return out


def translate(req: ChatCompletionRequest, default_max_tokens: int) -> Translated:
    """``req`` on the Messages pipeline, or a 400 naming what cannot be honoured."""
    _common_refusals(req)
    _chat_refusals(req)
    system, messages = _conversation(req)
    wanted = req.max_completion_tokens or req.max_tokens
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    body: dict[str, Any] = {
        "model": req.model,
        "max_tokens": wanted or default_max_tokens,
        "messages": messages,
        "system": system or None,
        "stream": bool(req.stream),
    }
    if req.tools:
        body["tools"] = [
            {
                "name": t.function.name,
                "description": t.function.description,
                "input_schema": t.function.parameters or {"type": "object", "properties": {}},
            }
            for t in req.tools
        ]
    if (choice := _tool_choice(req)) is not None:
        body["tool_choice"] = choice
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if stop:
        body["stop_sequences"] = stop
    user = req.safety_identifier or req.user
    if user:
        body["metadata"] = {"user_id": user}
    try:
        messages_request = MessagesRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise refuse("messages", f"{where}: {err.get('msg', 'invalid')}") from None
    opts = req.stream_options
    return Translated(
        body=messages_request,
        temperature=req.temperature,
        seed=req.seed,
        top_k=req.top_k,
        ignore_eos=bool(req.ignore_eos),
        clamp=wanted is None,
        include_usage=bool(opts and opts.include_usage),
        cache_key=req.prompt_cache_key,
        retain_24h=req.prompt_cache_retention == "24h",
    )


def completion_refusals(req: CompletionRequest) -> None:
    """The legacy endpoint's own refusals (after the shared ones)."""
    _common_refusals(req)
    if req.echo:
        raise unsupported("echo", "is not supported here")
    if req.logprobs is not None:
        raise unsupported("logprobs", "is not supported by this server")
    if req.best_of is not None and req.best_of > 1:
        raise unsupported("best_of", "greater than 1 is not supported here")
    if req.suffix:
        raise unsupported("suffix", "is not supported with this model")


def finish_reason(stop_reason: str | None, tool_calls: bool) -> str:
    """OpenAI's finish_reason for the pipeline's stop reason."""
    if tool_calls:
        return FINISH_TOOLS
    return FINISH.get(stop_reason or "end_turn", "stop")
