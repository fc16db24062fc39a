"""Operator-wide settings, read once from CACHEPOINT_OPERATOR_* environment variables.

These are the things a CacheReplica should not have to repeat: where the release's
NATS and OTLP collector live (the chart sets them), and how often to poll members.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, SecretStr

ENV_PREFIX = "CACHEPOINT_OPERATOR_"


class OperatorConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    nats_url: str | None = Field(None, description="set as CACHEPOINT_NATS_URL in member pods")
    otlp_endpoint: str | None = Field(
        None, description="set as OTEL_EXPORTER_OTLP_ENDPOINT in member pods"
    )
    stats_interval: float = Field(10.0, gt=0, description="seconds between /v1/stats polls")
    stats_timeout: float = Field(2.0, gt=0, description="per-member /v1/stats timeout, seconds")
    retry_delay: float = Field(10.0, gt=0, description="seconds before retrying a rolling step")
    internal_token: SecretStr | None = Field(
        None,
        description="the replicas' internal token: sent on /v1/stats polls and copied into "
        "each CacheReplica's credentials Secret for its members",
    )
    nats_users_secret: str | None = Field(
        None, description="the NATS users Secret to maintain in release_namespace; None = none"
    )
    release_namespace: str | None = Field(
        None, description="namespace of the chart's NATS and of nats_users_secret"
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if environ is None else environ
        values = {
            name: env[ENV_PREFIX + name.upper()]
            for name in cls.model_fields
            if env.get(ENV_PREFIX + name.upper())
        }
        return cls.model_validate(values)

    def token_digest(self) -> str | None:
        """A fingerprint of the internal token, for the pod template hash (pod.py).

        The pods hold the token by reference only, so a new one shows in no pod; yet it
        must reach every member (they read it at start): its digest rolls them.
        """
        token = self.internal_token
        return hashlib.sha256(token.get_secret_value().encode()).hexdigest()[:12] if token else None

    @property
    def maintains_nats_users(self) -> bool:
        return bool(self.nats_users_secret and self.release_namespace)
