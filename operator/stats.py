"""Read each member's GET /v1/stats, in parallel, with a short timeout.

A member that does not answer is reported with the error, never raised: one slow pod
must not stop the status of the others from being written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError


class _Stats(BaseModel):
    model_config = ConfigDict(extra="ignore")


class BlockStats(_Stats):
    total: int = 0
    active: int = 0
    cached_free: int = 0
    empty: int = 0
    retained: int = 0
    max_retained: int = 0


class ReplicaStats(_Stats):
    """The part of the replica's /v1/stats the operator puts into status."""

    replica: str = ""
    epoch: int
    model: str = ""
    blocks: BlockStats = BlockStats()
    entries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    hit_rate: float = 0.0
    evictions: int = 0
    waiting: int = 0
    running: int = 0


def stats_url(pod_ip: str, port: int) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 pod addresses
    return f"http://{host}:{port}/v1/stats"


async def _fetch(client: httpx.AsyncClient, url: str) -> ReplicaStats | str:
    try:
        response = await client.get(url)
        response.raise_for_status()
        return ReplicaStats.model_validate(response.json())
    except (httpx.HTTPError, ValueError, ValidationError) as e:
        return f"{type(e).__name__}: {e}"[:200]


async def poll(
    urls: Mapping[str, str], timeout: float, token: str | None = None
) -> dict[str, ReplicaStats | str]:
    """Stats (or an error message) per member name, for every member given a URL.

    ``token`` is the replicas' internal token: /v1/stats answers 401 without it.
    """
    if not urls:
        return {}
    headers = {"authorization": f"Bearer {token}"} if token else None
    # trust_env=False: an HTTP(S)_PROXY set for image pulls must not catch pod-IP traffic.
    async with httpx.AsyncClient(timeout=timeout, trust_env=False, headers=headers) as client:
        results = await asyncio.gather(*(_fetch(client, url) for url in urls.values()))
    return dict(zip(urls, results, strict=True))
