"""Names, labels and annotation keys shared by the builders, the handlers and the chart."""

from __future__ import annotations

GROUP = "cachepoint.dev"
VERSION = "v1alpha1"
PLURAL = "cachereplicas"
KIND = "CacheReplica"

# Every key the operator writes lives under the group, so `kubectl get -l` and RBAC
# audits can tell our objects and annotations apart from kopf's or Helm's.
LABEL_REPLICA = f"{GROUP}/replica"
LABEL_MEMBER = f"{GROUP}/member"
ANNOTATION_TEMPLATE_HASH = f"{GROUP}/template-hash"
ANNOTATION_MIN_CACHEABLE = f"{GROUP}/min-cacheable-tokens"
FINALIZER = f"{GROUP}/finalizer"

CONTAINER = "replica"
PORT_NAME = "http"
# The member index is appended as "-<n>", and the pod name doubles as the pod's DNS
# hostname (a 63-character label), so the CacheReplica name must leave room for it.
MAX_NAME_LENGTH = 56


# The member Secret's key holding the internal token (the same value for every member).
INTERNAL_TOKEN_KEY = "internal-token"
# The NATS users include: one Secret in the release namespace, rebuilt from every
# CacheReplica's members. users.conf is what nats-server reads; members.json is the
# operator's own record of which CacheReplica contributed which users.
USERS_CONF_KEY = "users.conf"
USERS_RECORD_KEY = "members.json"
GATEWAY_NATS_USER = "gateway"
# NOTE: nats-server resolves an unknown $VARIABLE from its environment, and variables
# do not cross `include` boundaries: the chart puts the gateway's password in the NATS
# container's env under this name, so the users file (written here) never holds it.
GATEWAY_PASSWORD_ENV = "CACHEPOINT_NATS_GATEWAY_PASSWORD"


def member_pod_name(replica: str, index: int) -> str:
    return f"{replica}-{index}"


def credentials_secret_name(replica: str) -> str:
    """The Secret holding one NATS password per member and the internal token."""
    return f"{replica}-credentials"


def service_name(replica: str) -> str:
    return replica


def replica_process_name(namespace: str, pod: str) -> str:
    """The name a replica announces on NATS (and its NATS user): unique across namespaces
    sharing one bus.

    NOTE: "_" joins them because no namespace or pod name can contain one: with "-",
    namespace team-a's pod x-0 and namespace team's pod a-x-0 would share a name, and
    one would take over the other's NATS identity and routing.
    """
    return f"{namespace}_{pod}"


def selector_labels(replica: str) -> dict[str, str]:
    """The labels that pick every member pod of one CacheReplica (Service, scale, list)."""
    return {LABEL_REPLICA: replica}


def selector_string(replica: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(replica).items())


def common_labels(replica: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "cachepoint-replica",
        "app.kubernetes.io/instance": replica,
        "app.kubernetes.io/component": "replica",
        "app.kubernetes.io/part-of": "cachepoint",
        "app.kubernetes.io/managed-by": "cachepoint-operator",
        **selector_labels(replica),
    }
