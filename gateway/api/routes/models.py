"""GET /v1/models: the configured models and those the live replicas report."""

from __future__ import annotations

from fastapi import APIRouter

from ...errors import not_found
from ...profiles import profile_of
from ...schemas.messages import ModelInfo, ModelList
from ...state import GatewayState
from ..deps import CallerDep, StateDep

router = APIRouter(tags=["models"])

_CREATED = "2026-11-01T00:00:00Z"


def _info(state: GatewayState, model: str) -> ModelInfo:
    # NOTE: each model id has its own window (its profile's context_window, else the
    # checkpoint's context length); as Anthropic's ModelInfo has them,
    # max_input_tokens is the window and max_tokens the output cap.
    window = profile_of(state.settings, model).context_window
    return ModelInfo(
        id=model,
        display_name=model,
        created_at=_CREATED,
        max_input_tokens=window,
        max_tokens=window - 1,
    )


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: StateDep, _: CallerDep) -> ModelList:
    data = [_info(state, m) for m in state.models()]
    return ModelList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/v1/models/{model_id}", response_model=ModelInfo)
async def get_model(model_id: str, state: StateDep, _: CallerDep) -> ModelInfo:
    if model_id not in state.models():
        raise not_found(f"model: {model_id}")
    return _info(state, model_id)
