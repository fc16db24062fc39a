"""The Admin API's API-key objects, as the official SDK sends and parses them
(``client.organization.api_keys``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cachepoint.gateway.db.models import ADMIN_KEY_PREFIX, KEY_PREFIX, ApiKey
from cachepoint.gateway.schemas.messages import reject_lone_surrogates


class UpdateApiKey(BaseModel):
    """POST /v1/organizations/api_keys/{api_key_id}. NOTE: ``archived`` (permanent in
    Anthropic's API) is refused: this ledger keeps one revocation time per key, and an
    archived key must never come back through ``active``."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=128)
    status: Literal["active", "inactive"] | None = None

    _unicode_only = model_validator(mode="before")(reject_lone_surrogates)


class WorkspaceScope(BaseModel):
    type: Literal["workspace"] = "workspace"
    workspace_id: str


class OrganizationScope(BaseModel):
    type: Literal["organization"] = "organization"


class ApiKeyOut(BaseModel):
    type: Literal["api_key"] = "api_key"
    id: str
    name: str
    status: Literal["active", "inactive"]
    created_at: str  # RFC 3339
    created_by: None = None
    expires_at: None = None
    partial_key_hint: str
    workspace_id: str | None
    scope: WorkspaceScope | OrganizationScope

    @classmethod
    def of(cls, key: ApiKey) -> ApiKeyOut:
        created = key.created_at
        if created.tzinfo is None:  # SQLite returns naive UTC datetimes
            created = created.replace(tzinfo=UTC)
        prefix = ADMIN_KEY_PREFIX if key.is_admin else KEY_PREFIX
        scope: WorkspaceScope | OrganizationScope = (
            WorkspaceScope(workspace_id=key.workspace_id)
            if key.workspace_id
            else OrganizationScope()
        )
        return cls(
            id=key.id,
            name=key.name,
            status="active" if key.revoked_at is None else "inactive",
            created_at=_rfc3339(created),
            partial_key_hint=f"{prefix}...{key.hint}",
            workspace_id=key.workspace_id,
            scope=scope,
        )


def _rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")
