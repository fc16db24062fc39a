"""The Admin API's API keys: read one, rename it, revoke or restore it. Scoped to the
admin key's org; a revocation takes effect on this gateway at once (its auth cache
entry is dropped) and on other gateways within ``auth_cache_seconds``."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from cachepoint.gateway.api.deps import AdminCallerDep, StateDep
from cachepoint.gateway.errors import ApiError, not_found
from cachepoint.gateway.schemas.admin import ApiKeyOut, UpdateApiKey
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.tenancy.tenants import org_key, update_key

router = APIRouter(prefix="/v1/organizations/api_keys", tags=["admin"])


def _missing(key_id: str) -> ApiError:
    return not_found(f"api key {key_id!r} not found")


@router.get("/{api_key_id}", response_model=ApiKeyOut)
async def get_api_key(api_key_id: str, state: StateDep, ctx: AdminCallerDep) -> ApiKeyOut:
    def read() -> ApiKeyOut | None:
        with state.sessions() as session:
            key = org_key(session, ctx.org_id, api_key_id)
            return ApiKeyOut.of(key) if key is not None else None

    out = await run_in_threadpool(read)
    if out is None:
        raise _missing(api_key_id)
    return out


@router.post("/{api_key_id}", response_model=ApiKeyOut)
async def update_api_key(
    api_key_id: str, body: UpdateApiKey, state: StateDep, ctx: AdminCallerDep
) -> ApiKeyOut:
    done = await run_in_threadpool(_update, state, ctx.org_id, api_key_id, body)
    if done is None:
        raise _missing(api_key_id)
    out, key_hash = done
    # NOTE: after the commit, so a lookup that races it reads the new state.
    state.forget_key(key_hash)
    return out


def _update(
    state: GatewayState, org_id: str, key_id: str, body: UpdateApiKey
) -> tuple[ApiKeyOut, str] | None:
    """(the key as it now is, its stored hash), or None if the org has no such key."""
    active = None if body.status is None else body.status == "active"
    with state.sessions() as session:
        key = org_key(session, org_id, key_id)
        if key is None:
            return None
        update_key(session, key, name=body.name, active=active)
        session.commit()
        return ApiKeyOut.of(key), key.key_hash
