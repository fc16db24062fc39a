"""Per-model settings: each served model's context window, minimum cacheable length and
stop ids, from ``model_profiles`` over the gateway-wide defaults."""

from __future__ import annotations

from dataclasses import dataclass

from cachepoint.gateway.settings import GatewaySettings


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """What the gateway enforces and sends for one model id."""

    # prompt + max_tokens limit, and /v1/models' max_input_tokens
    context_window: int
    # breakpoints ending before this many tokens write no cache entry (contract §3)
    min_cacheable_tokens: int
    # sent to the replica: ids that end the turn besides the checkpoint's own EOS ids
    stop_token_ids: tuple[int, ...]


def profile_of(settings: GatewaySettings, model: str) -> ModelProfile:
    """The profile of ``model``: its ``model_profiles`` entry, each unset field taken
    from the gateway-wide setting. NOTE: ``max_context_tokens`` is already the served
    checkpoint's window unless set (app.create_app), so that is every model's default."""
    own = settings.model_profiles.get(model)
    if own is None:
        return ModelProfile(settings.max_context_tokens, settings.min_cacheable_tokens, ())
    return ModelProfile(
        context_window=(
            settings.max_context_tokens if own.context_window is None else own.context_window
        ),
        min_cacheable_tokens=(
            settings.min_cacheable_tokens
            if own.min_cacheable_tokens is None
            else own.min_cacheable_tokens
        ),
        stop_token_ids=tuple(own.stop_token_ids or ()),
    )
