"""GET /v1/models: the configured models and those the live replicas report."""

from __future__ import annotations

from fastapi import APIRouter

from ...errors import not_found
from ...schemas.messages import ModelInfo, ModelList
from ..deps import CallerDep, StateDep

router = APIRouter(tags=["models"])

_CREATED = "2026-11-01T00:00:00Z"


@router.get("/v1/models", response_model=ModelList)
async def list_models(state: StateDep, _: CallerDep) -> ModelList:
    data = [ModelInfo(id=m, display_name=m, created_at=_CREATED) for m in state.models()]
    return ModelList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/v1/models/{model_id}", response_model=ModelInfo)
async def get_model(model_id: str, state: StateDep, _: CallerDep) -> ModelInfo:
    if model_id not in state.models():
        raise not_found(f"model: {model_id}")
    return ModelInfo(id=model_id, display_name=model_id, created_at=_CREATED)
