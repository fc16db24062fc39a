"""GET /v1/models: the configured models, those the live replicas report, and the
aliases (names, not patterns) that point at one of them, in a shape both the Anthropic
and the OpenAI SDK parse."""

from __future__ import annotations

from fastapi import APIRouter

from cachepoint.gateway.api.deps import CallerDep, StateDep
from cachepoint.gateway.profiles import profile_of
from cachepoint.gateway.schemas.messages import ModelInfo, ModelList
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.tenancy import aliases

router = APIRouter(tags=["models"])

_CREATED = "2026-11-01T00:00:00Z"
_CREATED_S = 1_793_491_200  # the same instant in epoch seconds (OpenAI's `created`)


def _info(state: GatewayState, model: str, served: str | None = None) -> ModelInfo:
    # NOTE: each model id has its own window (its profile's context_window, else the
    # checkpoint's context length); as Anthropic's ModelInfo has them,
    # max_input_tokens is the window and max_tokens the output cap. An alias reports
    # the window of the model it resolves to.
    window = profile_of(state.settings, served or model).context_window
    return ModelInfo(
        id=model,
        display_name=model if served is None else f"{model} (alias of {served})",
        created_at=_CREATED,
        created=_CREATED_S,
        max_input_tokens=window,
        max_tokens=window - 1,
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: StateDep, _: CallerDep) -> ModelList:
    models = state.models()
    named = aliases.concrete(await aliases.table(state))
    data = [_info(state, m) for m in models]
    data += [
        _info(state, a, t) for a, t in sorted(named.items()) if t in models and a not in models
    ]
    return ModelList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/v1/models/{model_id}", response_model=ModelInfo)
async def get_model(model_id: str, state: StateDep, _: CallerDep) -> ModelInfo:
    served = await aliases.resolve(state, model_id)  # 404 not_found_error when none
    return _info(state, model_id, None if served == model_id else served)
