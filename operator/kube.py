"""The few Kubernetes API calls the handlers make, on plain dicts, and the login.

The official client is synchronous: kopf runs sync handlers in its thread pool, and
the async timer wraps these calls in `asyncio.to_thread`. Responses are read raw
(`_preload_content=False`) so builders and checks see the same camelCase dicts the
API serves, never generated model objects.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import kopf
import kubernetes
from kubernetes.client.exceptions import ApiException

from cachepoint.operator.naming import GROUP, PLURAL, VERSION

TIMEOUT = 15.0  # seconds per API call; a hung call must not hold a kopf worker forever
JSON_PATCH = "application/json-patch+json"


def configure() -> kubernetes.client.Configuration:
    """Load credentials into the client's default configuration and return a copy.

    In a pod: the service account. Elsewhere: $KUBECONFIG (or ~/.kube/config), read now,
    not when `kubernetes` was imported, which is when its own default is captured.
    """
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return kubernetes.client.Configuration.get_default_copy()


def connection_info(config: kubernetes.client.Configuration) -> kopf.ConnectionInfo:
    """Hand kopf's own watcher the credentials the client just loaded, so both agree."""
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix(
        "authorization"
    )
    scheme, token = None, None
    if header:
        first, _, rest = header.partition(" ")
        scheme, token = (first, rest) if rest else (None, first)
    return kopf.ConnectionInfo(
        server=config.host,
        ca_path=config.ssl_ca_cert,
        insecure=not config.verify_ssl,
        username=config.username or None,
        password=config.password or None,
        scheme=scheme,
        token=token,
        certificate_path=config.cert_file,
        private_key_path=config.key_file,
    )


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    """Whether `obj` has an owner reference to the object with this uid."""
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


def _core() -> kubernetes.client.CoreV1Api:
    # A client per call: cheap, and a re-login (new server or token) takes effect at once.
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient())


def _json(response: Any) -> dict[str, Any]:
    data = response.data
    return json.loads(data) if data else {}


def _custom() -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient())


def get_cache_replica(namespace: str, name: str) -> dict[str, Any] | None:
    """The CacheReplica as the API has it now (not kopf's copy from the event)."""
    method = _custom().get_namespaced_custom_object
    response = _call(404, method, GROUP, VERSION, namespace, PLURAL, name)
    return None if response is None else _json(response)


def list_cache_replicas(namespace: str) -> list[dict[str, Any]]:
    """Every CacheReplica in one namespace (namespaced: a Role there is enough)."""
    response = _custom().list_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, _preload_content=False, _request_timeout=TIMEOUT
    )
    return list(_json(response).get("items") or [])


def list_pods(namespace: str, selector: str) -> list[dict[str, Any]]:
    response = _core().list_namespaced_pod(
        namespace, label_selector=selector, _preload_content=False, _request_timeout=TIMEOUT
    )
    return list(_json(response).get("items") or [])


def _call(expected: int, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any | None:
    """Make one raw API call; None when it fails with ``expected`` (404 gone, 409 exists),
    which the callers treat as an answer rather than an error."""
    try:
        return method(*args, _preload_content=False, _request_timeout=TIMEOUT, **kwargs)
    except ApiException as e:
        if e.status == expected:
            return None
        raise


class CreateRejected(ApiException):
    """The API refused to create a child (403 forbidden, 422 invalid, ...): a retry gets
    the same answer until someone changes RBAC, a quota or an admission policy.

    An ApiException still, so callers that only know those keep working; `message` is
    the API's own explanation (the Status object's `message`).
    """

    def __init__(self, kind: str, name: str, error: ApiException) -> None:
        super().__init__(status=error.status, reason=error.reason)
        self.body, self.headers = error.body, error.headers
        self.kind, self.name = kind, name
        self.message = f"create {kind} {name}: {error.status} {_status_message(error)}"


def _status_message(error: ApiException) -> str:
    body = error.body
    try:
        data = json.loads(body) if body else {}
    except (TypeError, ValueError):
        data = {}
    if isinstance(data, dict) and data.get("message"):
        return str(data["message"])
    return str(error.reason or "")


def _create(kind: str, method: Callable[..., Any], obj: dict[str, Any]) -> bool:
    """Create; False when one of that name already exists (another pass got there)."""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    try:
        return _call(409, method, ns, obj) is not None
    except ApiException as e:
        # NOTE: 429 (throttled) is the API asking to come back later, not a refusal.
        if e.status is not None and 400 <= e.status < 500 and e.status != 429:
            raise CreateRejected(kind, name, e) from e
        raise


def create_pod(pod: dict[str, Any]) -> bool:
    """Create; False when a pod of that name already exists (another pass got there)."""
    return _create("Pod", _core().create_namespaced_pod, pod)


def delete_pod(namespace: str, name: str) -> bool:
    """Delete; False when it was already gone."""
    return _call(404, _core().delete_namespaced_pod, name, namespace) is not None


def get_service(namespace: str, name: str) -> dict[str, Any] | None:
    response = _call(404, _core().read_namespaced_service, name, namespace)
    return None if response is None else _json(response)


def _json_patch(method: Any, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
    """A JSON patch (RFC 6902) through a namespaced ``patch_*`` method of the client."""
    method(
        name,
        namespace,
        ops,
        _content_type=JSON_PATCH,
        _preload_content=False,
        _request_timeout=TIMEOUT,
    )


def create_service(service: dict[str, Any]) -> bool:
    return _create("Service", _core().create_namespaced_service, service)


def patch_service(namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
    _json_patch(_core().patch_namespaced_service, namespace, name, ops)


def delete_service(namespace: str, name: str) -> bool:
    return _call(404, _core().delete_namespaced_service, name, namespace) is not None


def get_secret(namespace: str, name: str) -> dict[str, Any] | None:
    response = _call(404, _core().read_namespaced_secret, name, namespace)
    return None if response is None else _json(response)


def create_secret(secret: dict[str, Any]) -> bool:
    return _create("Secret", _core().create_namespaced_secret, secret)


def patch_secret(namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
    """JSON patch; start `ops` with a `test` of resourceVersion to make it conditional
    (the API then answers 422 if someone wrote the Secret in between)."""
    _json_patch(_core().patch_namespaced_secret, namespace, name, ops)


def delete_secret(namespace: str, name: str) -> bool:
    return _call(404, _core().delete_namespaced_secret, name, namespace) is not None


def _policy() -> kubernetes.client.PolicyV1Api:
    return kubernetes.client.PolicyV1Api(kubernetes.client.ApiClient())


def get_pdb(namespace: str, name: str) -> dict[str, Any] | None:
    response = _call(404, _policy().read_namespaced_pod_disruption_budget, name, namespace)
    return None if response is None else _json(response)


def create_pdb(pdb: dict[str, Any]) -> bool:
    return _create("PodDisruptionBudget", _policy().create_namespaced_pod_disruption_budget, pdb)


def patch_pdb(namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
    _json_patch(_policy().patch_namespaced_pod_disruption_budget, namespace, name, ops)


def delete_pdb(namespace: str, name: str) -> bool:
    method = _policy().delete_namespaced_pod_disruption_budget
    return _call(404, method, name, namespace) is not None


# NetworkPolicies: no delete. The policy must outlive the members it guards, so the
# garbage collector removes it (owner reference) once the CacheReplica itself is gone.
def _networking() -> kubernetes.client.NetworkingV1Api:
    return kubernetes.client.NetworkingV1Api(kubernetes.client.ApiClient())


def get_network_policy(namespace: str, name: str) -> dict[str, Any] | None:
    response = _call(404, _networking().read_namespaced_network_policy, name, namespace)
    return None if response is None else _json(response)


def create_network_policy(policy: dict[str, Any]) -> bool:
    return _create("NetworkPolicy", _networking().create_namespaced_network_policy, policy)


def patch_network_policy(namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
    _json_patch(_networking().patch_namespaced_network_policy, namespace, name, ops)
