"""Errors in the Anthropic envelope: {"type": "error", "error": {...}, "request_id": ...}."""

from __future__ import annotations


class ApiError(Exception):
    """Raised anywhere in the gateway; leaves as one HTTP status and error type."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message


def invalid(message: str) -> ApiError:
    return ApiError(400, "invalid_request_error", message)


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
