"""Operator-wide settings, read once from CACHEPOINT_OPERATOR_* environment variables.

These are the things a CacheReplica should not have to repeat: where the release's
NATS and OTLP collector live (the chart sets them), who may reach the members (the
release's gateway and operator pods, and the metrics scrapers), and how often to poll
members. Structured values (labels, peers) come as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

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
        None,
        description="the chart's namespace: where NATS, nats_users_secret, the gateway and "
        "the operator run",
    )
    network_policy: bool = Field(
        False,
        description="keep one NetworkPolicy per CacheReplica in its namespace: the members' "
        "http port only from the gateway and operator pods in release_namespace and from "
        "metrics_from",
    )
    gateway_pod_labels: dict[str, str] = Field(
        default_factory=dict, description="labels of the gateway's pods (JSON object)"
    )
    operator_pod_labels: dict[str, str] = Field(
        default_factory=dict, description="labels of the operator's own pods (JSON object)"
    )
    metrics_from: list[dict[str, Any]] = Field(
        default_factory=list,
        description="NetworkPolicyPeers that may also reach the members' http port, for "
        "their /metrics (JSON list); empty = none",
    )

    @field_validator("gateway_pod_labels", "operator_pod_labels", "metrics_from", mode="before")
    @classmethod
    def _from_json(cls, value: Any) -> Any:
        """The environment holds these as JSON (the chart writes them with toJson)."""
        if isinstance(value, str):
            return json.loads(value)
        return value

    @model_validator(mode="after")
    def _network_policy_knows_its_peers(self) -> OperatorConfig:
        # NOTE: an empty podSelector next to a namespaceSelector matches every pod of the
        # release namespace: refuse to start rather than open the members that wide.
        if self.network_policy:
            missing = [
                name
                for name in ("release_namespace", "gateway_pod_labels", "operator_pod_labels")
                if not getattr(self, name)
            ]
            if missing:
                raise ValueError(f"network_policy needs {', '.join(missing)}")
        return self

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
