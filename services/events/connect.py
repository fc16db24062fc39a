"""The first connection to NATS, retried until it works; nats-py reconnects after that.

Both sides start before NATS may be up (the embedded stack, a pod restart), and
neither may fail because of it: they serve without the event plane meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)


async def connect_forever(
    url: str,
    name: str,
    retry_s: float = 1.0,
    *,
    user: str | None = None,
    password: str | None = None,
    **callbacks: Any,
) -> Client:
    """Connect as ``user`` when credentials are given (the server then applies that
    user's subject permissions), anonymously otherwise."""
    creds: dict[str, str] = {}
    if user is not None and password is not None:
        creds = {"user": user, "password": password}
    while True:
        try:
            return await nats.connect(
                url,
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                **creds,
                **callbacks,
            )
        except Exception as exc:
            log.warning("NATS %s unreachable (%s); retrying in %.0fs", url, exc, retry_s)
            await asyncio.sleep(retry_s)
