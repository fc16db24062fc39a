"""Orgs, workspaces, API keys and scope policies. Keys are shown once, stored hashed."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from cachepoint.gateway.contract.breakpoints import ScopePolicy
from cachepoint.gateway.db.models import ADMIN_KEY_PREFIX, KEY_PREFIX, ApiKey, Org, Workspace


class TenantError(ValueError):
    """A tenant operation that cannot be done (unknown name, duplicate, ...)."""


@dataclass(frozen=True, slots=True)
class KeyContext:
    """Who is calling: resolved from an API key."""

    key_id: str  # api_keys.id
    org_id: str
    workspace_id: str | None
    is_admin: bool  # admin keys read reports; they cannot send messages
    policy: ScopePolicy  # the org's global-scope policy
    retained_share: float | None = None  # the org's retention quota; None = replica default


def hash_key(raw: str) -> str:
    # NOTE: a fast hash is right here: keys carry 256 bits of entropy, so there is
    # nothing to brute-force, and auth sits on every request's path.
    return hashlib.sha256(raw.encode()).hexdigest()


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def create_org(session: Session, name: str) -> Org:
    org = Org(id=_new_id("org"), name=name, allow_global_scope=False, global_allowlist="")
    session.add(org)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise TenantError(f"org {name!r} already exists") from None
    return org


def get_org(session: Session, name_or_id: str) -> Org:
    org = session.scalar(select(Org).where((Org.name == name_or_id) | (Org.id == name_or_id)))
    if org is None:
        raise TenantError(f"no org named {name_or_id!r}")
    return org


def create_workspace(session: Session, org: Org, name: str) -> Workspace:
    ws = Workspace(id=_new_id("wrkspc"), org_id=org.id, name=name)
    session.add(ws)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise TenantError(f"workspace {name!r} already exists in {org.name}") from None
    return ws


def get_workspace(session: Session, org: Org, name_or_id: str) -> Workspace:
    ws = session.scalar(
        select(Workspace).where(
            Workspace.org_id == org.id,
            (Workspace.name == name_or_id) | (Workspace.id == name_or_id),
        )
    )
    if ws is None:
        raise TenantError(f"no workspace {name_or_id!r} in org {org.name}")
    return ws


def create_key(
    session: Session,
    org: Org,
    *,
    name: str = "",
    workspace: Workspace | None = None,
    admin: bool = False,
) -> tuple[ApiKey, str]:
    """Returns the row and the raw key; the raw key is never stored or shown again."""
    raw = (ADMIN_KEY_PREFIX if admin else KEY_PREFIX) + secrets.token_urlsafe(32)
    key = ApiKey(
        id=_new_id("apikey"),
        org_id=org.id,
        workspace_id=workspace.id if workspace else None,
        name=name,
        key_hash=hash_key(raw),
        hint=raw[-4:],
        is_admin=admin,
    )
    session.add(key)
    session.flush()
    return key, raw


def revoke_key(session: Session, key_id: str) -> ApiKey:
    key = session.get(ApiKey, key_id)
    if key is None:
        raise TenantError(f"no key {key_id!r}")
    if key.revoked_at is None:
        key.revoked_at = datetime.now(UTC)
    return key


def org_key(session: Session, org_id: str, key_id: str) -> ApiKey | None:
    """The key with this id if it belongs to ``org_id``; None for another org's key, so
    that an admin key cannot even learn that one exists."""
    key = session.get(ApiKey, key_id)
    return key if key is not None and key.org_id == org_id else None


def update_key(
    session: Session, key: ApiKey, *, name: str | None = None, active: bool | None = None
) -> ApiKey:
    """Rename a key, revoke it (active=False) or restore it (active=True)."""
    if name is not None:
        key.name = name
    if active is False and key.revoked_at is None:
        key.revoked_at = datetime.now(UTC)
    elif active is True:
        key.revoked_at = None
    session.flush()
    return key


def set_policy(
    session: Session, org: Org, *, allow_global: bool, allowlist: list[str] | None = None
) -> None:
    org.allow_global_scope = allow_global
    if allowlist is not None:
        org.global_allowlist = "\n".join(sorted(set(allowlist)))


def authenticate(session: Session, raw: str) -> KeyContext | None:
    """The caller behind a raw key, or None for unknown or revoked keys."""
    row = session.execute(
        select(ApiKey, Org)
        .join(Org, Org.id == ApiKey.org_id)
        .where(ApiKey.key_hash == hash_key(raw), ApiKey.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    key, org = row
    allow = frozenset(d for d in org.global_allowlist.split("\n") if d)
    return KeyContext(
        key_id=key.id,
        org_id=org.id,
        workspace_id=key.workspace_id,
        is_admin=key.is_admin,
        policy=ScopePolicy(allow_global=org.allow_global_scope, allowlist=allow),
        retained_share=org.retained_share,
    )
