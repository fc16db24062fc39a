"""Errors, in the envelope of the API the request came to: Anthropic's
{"type": "error", "error": {...}, "request_id": ...} on the Messages API, OpenAI's
{"error": {"message", "type", "param", "code"}} on its endpoints."""

from __future__ import annotations


class ApiError(Exception):
    """Raised anywhere in the gateway; leaves as one HTTP status and error type."""

    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param  # the request parameter at fault (OpenAI's envelope names it)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request_error", message, param)


def unauthenticated(message: str = "invalid x-api-key") -> ApiError:
    return ApiError(401, "authentication_error", message)


def forbidden(message: str) -> ApiError:
    return ApiError(403, "permission_error", message)


def not_found(message: str) -> ApiError:
    return ApiError(404, "not_found_error", message)


def too_large(message: str) -> ApiError:
    return ApiError(413, "request_too_large", message)


def rate_limited(message: str) -> ApiError:
    return ApiError(429, "rate_limit_error", message)


def overloaded(message: str) -> ApiError:
    return ApiError(529, "overloaded_error", message)


def internal(message: str = "internal error") -> ApiError:
    return ApiError(500, "api_error", message)


def envelope(kind: str, message: str, request_id: str | None) -> dict[str, object]:
    return {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": request_id,
    }


# The OpenAI-compatible endpoints: their errors leave in OpenAI's envelope.
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

# Anthropic's error type -> OpenAI's (type, code); the status stays, but for 529.
_OPENAI_KINDS: dict[str, tuple[str, str | None]] = {
    "invalid_request_error": ("invalid_request_error", None),
    "authentication_error": ("invalid_request_error", "invalid_api_key"),
    "permission_error": ("invalid_request_error", "permission_denied"),
    "not_found_error": ("invalid_request_error", "not_found"),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit_error": ("requests", "rate_limit_exceeded"),
    "overloaded_error": ("server_error", "overloaded"),
    "timeout_error": ("server_error", "timeout"),
    "api_error": ("server_error", None),
}


def openai_envelope(kind: str, message: str, param: str | None = None) -> dict[str, object]:
    """OpenAI's error body for an error of Anthropic type ``kind``."""
    typ, code = _OPENAI_KINDS.get(kind, ("server_error", None))
    if kind == "not_found_error" and message.startswith("model"):
        code = "model_not_found"
    return {"error": {"message": message, "type": typ, "param": param, "code": code}}


def error_body(
    path: str, status: int, kind: str, message: str, request_id: str | None, param: str | None
) -> tuple[int, dict[str, object]]:
    """(status, body) of an error on ``path``, in its API's envelope. NOTE: 529 is
    Anthropic's own; OpenAI's clients know 503 for an overloaded server."""
    if path in OPENAI_PATHS:
        return (503 if status == 529 else status), openai_envelope(kind, message, param)
    return status, envelope(kind, message, request_id)
