"""The wire protocol's version, and how a peer speaking another one is told.

The gateway sends ``VERSION_HEADER: PROTOCOL_VERSION`` on every generate call; the
replica answers a call that names another version with ``VERSION_MISMATCH_STATUS`` and
a message naming both, before it reads the body (a body of another version may not
even validate). NOTE: a call without the header is taken as this version: a gateway
from before the header existed speaks version 1, so a rolling update that adds the
header breaks nobody. Bump the version only for a change an older peer would misread
(a field renamed or reinterpreted); an added field with a default, or a new event type
(skipped by a peer that does not know it), needs no bump.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
VERSION_HEADER = "cachepoint-protocol"
# NOTE: 409 Conflict, not 400: the body may be fine, the two peers disagree; and not
# 503, which the gateway takes as "route elsewhere" (every replica would say the same).
VERSION_MISMATCH_STATUS = 409


def version_mismatch(sent: str | None) -> str | None:
    """None when a caller that sent ``sent`` (the header's value; None: no header)
    speaks this side's version; else the message to answer it with."""
    if sent is None or sent.strip() == str(PROTOCOL_VERSION):
        return None
    return (
        f"protocol version mismatch: the caller speaks cachepoint protocol {sent.strip()!r}, "
        f"this replica speaks {PROTOCOL_VERSION}"
    )
