"""One dependency for each generation route: the caller, its betas and its admission
resolved in one call, in the order their errors take precedence (401/403, then 400,
then 429), as separate dependencies resolved them.

NOTE: one dependency, not five: FastAPI walks every sub-dependency of a route on each
request, and the five (with the state and caller they share) cost more on this path
than the request's routing decision (bench/RESULTS.md, "The replica hop").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from cachepoint.gateway.api.deps import get_betas, get_caller, get_state, message_caller
from cachepoint.gateway.api.limits import admit, admit_openai
from cachepoint.gateway.state import GatewayState
from cachepoint.gateway.tenancy.tenants import KeyContext


@dataclass(frozen=True, slots=True)
class Call:
    """What a generation route needs of its request before it reads the body."""

    state: GatewayState  # the app's state
    ctx: KeyContext  # the caller behind the API key (never an admin key)
    rid: str  # the request id (the middleware's)
    betas: set[str]  # the anthropic-beta set (empty on the OpenAI routes)


async def messages_call(request: Request) -> Call:
    state = await get_state(request)
    ctx = await message_caller(await get_caller(request, state))
    betas = await get_betas(request, state)
    await admit(request, state, ctx)
    return Call(state, ctx, str(request.state.request_id), betas)


async def openai_call(request: Request) -> Call:
    state = await get_state(request)
    ctx = await message_caller(await get_caller(request, state))
    await admit_openai(request, state, ctx)
    return Call(state, ctx, str(request.state.request_id), set())


MessagesCallDep = Annotated[Call, Depends(messages_call)]
OpenAICallDep = Annotated[Call, Depends(openai_call)]
