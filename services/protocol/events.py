"""The NDJSON events of a streamed generate (``stream: true``), one type per event.

A stream is ``prefill_done`` (the final cache report), then one ``token`` per sampled
token, then ``done`` (the final response) or ``error``. Each event's name is its
``type`` field's one value, defined here only: both sides encode and decode through
this module, so neither spells a name.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, get_args

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from cachepoint.protocol.response import CacheReport, GenerateResponse


class PrefillDoneEvent(BaseModel):
    """The prefill is committed: its cache report is final, and billing may start."""

    reports_usage: ClassVar[bool] = True  # its payload is what the gateway bills

    type: Literal["prefill_done"] = "prefill_done"
    cache: CacheReport


class TokenEvent(BaseModel):
    """One sampled token, with the text it completes (may be empty: a partial glyph)."""

    reports_usage: ClassVar[bool] = False

    type: Literal["token"] = "token"
    token_id: int
    text: str


class DoneEvent(BaseModel):
    """The last event of a generation that ended well: the final response."""

    reports_usage: ClassVar[bool] = True  # its output_tokens is billed

    type: Literal["done"] = "done"
    response: GenerateResponse


class ErrorDetail(BaseModel):
    # the error kind, as Anthropic's (overloaded_error, api_error, ...); one that names
    # none is an internal error
    type: str = "api_error"
    message: str


class ErrorEvent(BaseModel):
    """The last event of a generation that failed after its prefill. NOTE: also the
    body of every error answer of the replica's API: one envelope for both."""

    reports_usage: ClassVar[bool] = False

    type: Literal["error"] = "error"
    error: ErrorDetail

    @classmethod
    def of(cls, kind: str, message: str) -> ErrorEvent:
        return cls(error=ErrorDetail(type=kind, message=message))


Event = PrefillDoneEvent | TokenEvent | DoneEvent | ErrorEvent
_EVENTS: TypeAdapter[Event] = TypeAdapter(Annotated[Event, Field(discriminator="type")])
EVENT_TYPES: dict[str, type[Event]] = {
    cls.model_fields["type"].default: cls for cls in get_args(Event)
}


def event_name(cls: type[Event]) -> str:
    """The name an event type goes by on the wire."""
    name: str = cls.model_fields["type"].default
    return name


class MalformedEvent(ValueError):
    """A line that is not an event of this protocol: not a JSON object, or an event
    whose fields do not validate."""

    def __init__(self, event: type[Event] | None, detail: str) -> None:
        super().__init__(detail)
        self.event = event  # the event type it claims to be; None if none we know
        self.detail = detail  # what is wrong with it, one line

    @property
    def reports_usage(self) -> bool:
        """It claims to carry a usage report: to the gateway, an unusable one."""
        return self.event is not None and self.event.reports_usage


def encode_event(event: Event) -> bytes:
    """One NDJSON line: the event's compact JSON and a newline."""
    return _EVENTS.dump_json(event) + b"\n"


def decode_event(line: bytes | str) -> Event | None:
    """The event on one NDJSON line; None for an event type this version does not know
    (a newer peer's addition, skipped: see version.py).

    NOTE: strict, whatever the models allow a Python caller: a count must be a JSON
    integer, never ``1.5``, ``"5"`` or ``true``, because the gateway bills from them."""
    try:
        return _EVENTS.validate_json(line, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        first = errors[0]
        if first["type"] == "union_tag_invalid":
            return None
        loc = first["loc"]
        event = EVENT_TYPES.get(str(loc[0])) if loc else None
        where = ".".join(str(x) for x in loc)
        detail = f"{where}: {first['msg']}" if where else str(first["msg"])
        raise MalformedEvent(event, detail[:200]) from None
