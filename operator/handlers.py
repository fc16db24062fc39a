"""kopf handlers for CacheReplica: thin glue between events and the pure builders.

- create / update / resume: check the spec, then the credentials Secret and this
  CacheReplica's users in the NATS users include, then converge the Service and
  members (rolling one member at a time); TemporaryError until the roll settles.
- a timer: re-assert the credentials and NATS users, heal missing members, poll every
  member's /v1/stats (with the internal token), write status.
- delete: remove the children and the credentials, drop the NATS users, then kopf
  releases the finalizer.
- one pruner per operator (startup to cleanup): drops the NATS users of every
  CacheReplica that is gone or being deleted, whatever wrote them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from . import children, credentials, kube, stats
from .config import OperatorConfig
from .naming import FINALIZER, GROUP, PLURAL, VERSION
from .pod import template_hash
from .spec import SpecError, check
from .status import build_invalid_status, build_status

CONFIG = OperatorConfig.from_env()
RESOURCE = (GROUP, VERSION, PLURAL)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api_error(e: ApiException) -> kopf.TemporaryError:
    return kopf.TemporaryError(f"Kubernetes API: {e.status} {e.reason}", delay=CONFIG.retry_delay)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Our own keys instead of kopf.zalando.org/*, and no status.kopf (the schema prunes it).
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    # The CRD is installed before the operator (chart crds/), and namespaces are named
    # exactly, so no cluster-wide watch on CRDs or namespaces is needed (nor granted).
    settings.scanning.disabled = True


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return kube.connection_info(kube.configure())


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
def reconcile(
    body: kopf.Body,
    name: str,
    namespace: str,
    uid: str,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    patch: kopf.Patch,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    patch.status["observedGeneration"] = meta.get("generation")
    try:
        replica = check(name, spec)
    except SpecError as e:
        # Level-based: the timer writes the same status while the spec stays invalid.
        patch.status.update(build_invalid_status(e.problems, dict(status), _now()))
        kopf.warn(body, reason="InvalidSpec", message=str(e))
        raise kopf.PermanentError(f"invalid spec: {e}") from None
    try:
        # Credentials first: a member pod cannot start before the Secret it reads.
        passwords = credentials.ensure_credentials(body, name, namespace, replica.replicas, CONFIG)
        if credentials.sync_nats_users(CONFIG, namespace, name, passwords):
            logger.info("NATS users updated")
        service = children.ensure_service(body, name, namespace, replica)
        step = children.converge_members(body, name, namespace, uid, replica, CONFIG, roll=True)
    except ApiException as e:
        raise _api_error(e) from e
    except (children.ForeignChild, credentials.ForeignSecret) as e:
        # Not ours to fix: say so once per attempt, and look again now and then.
        kopf.warn(body, reason="NameConflict", message=str(e))
        raise kopf.TemporaryError(str(e), delay=max(60.0, CONFIG.retry_delay)) from e
    if service:
        logger.info(f"Service {service}")
    if step.create or step.delete:
        logger.info(f"members: created {step.create}, deleted {step.delete}")
    if not step.settled:
        raise kopf.TemporaryError("; ".join(step.waiting), delay=CONFIG.retry_delay)


def _still_live(namespace: str, name: str, uid: str) -> bool:
    """Whether this very CacheReplica object still exists and is not being deleted."""
    current = kube.get_cache_replica(namespace, name)
    meta = (current or {}).get("metadata") or {}
    return meta.get("uid") == uid and not meta.get("deletionTimestamp")


async def prune_users_forever(interval: float, logger: logging.Logger) -> None:
    """Every `interval`, drop the NATS users of CacheReplicas that are gone or going.

    Per-object timers stop with their object, so this runs once per operator, even with
    no CacheReplica left (the last one's users must go too).
    """
    while True:
        try:
            if await asyncio.to_thread(credentials.prune_nats_users, CONFIG):
                logger.info("NATS users of deleted CacheReplicas removed")
        except ApiException as e:
            logger.warning(f"cannot prune NATS users: {e.status} {e.reason}")
        except Exception:
            # NOTE: the loop must outlive any one failure, or stale users stay for good.
            logger.exception("cannot prune NATS users")
        await asyncio.sleep(interval)


@kopf.on.startup()
async def start_pruner(memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    if CONFIG.maintains_nats_users:
        log = logging.getLogger("cachepoint.operator.pruner")
        memo["pruner"] = asyncio.create_task(prune_users_forever(CONFIG.stats_interval, log))
        logger.info("pruning NATS users of deleted CacheReplicas")


@kopf.on.cleanup()
async def stop_pruner(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("pruner")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@kopf.timer(*RESOURCE, interval=CONFIG.stats_interval)
async def refresh_status(
    body: kopf.Body,
    name: str,
    namespace: str,
    uid: str,
    spec: kopf.Spec,
    status: kopf.Status,
    meta: kopf.Meta,
    patch: kopf.Patch,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    try:
        replica = check(name, spec)
    except SpecError as e:
        patch.status.update(build_invalid_status(e.problems, dict(status), _now()))
        return
    try:
        # Bare pods have no controller but us: put back members that vanished (eviction,
        # node loss, kubectl delete). Creating and rolling stay with the handlers, so
        # only once they have seen the object (observedGeneration is theirs to write),
        # and never while it is being deleted.
        handled = status.get("observedGeneration") is not None
        if handled and not meta.get("deletionTimestamp"):
            # Level-based: the users include is re-asserted on every tick, so a users
            # Secret that Helm reset or another writer dropped is repaired here.
            passwords = await asyncio.to_thread(
                credentials.ensure_credentials, body, name, namespace, replica.replicas, CONFIG
            )
            # NOTE: `meta` is from when this tick began; the object may have been deleted
            # since, and writing its users now would undo the delete handler's removal.
            # Ask again right before writing (the pruner catches what still slips by).
            if await asyncio.to_thread(_still_live, namespace, name, uid):
                await asyncio.to_thread(
                    credentials.sync_nats_users, CONFIG, namespace, name, passwords
                )
                await asyncio.to_thread(
                    children.converge_members,
                    body,
                    name,
                    namespace,
                    uid,
                    replica,
                    CONFIG,
                    roll=False,
                )
        pods = await asyncio.to_thread(children.owned_pods, namespace, name, uid)
    except ApiException as e:
        logger.warning(f"cannot list members: {e.status} {e.reason}")
        return
    except credentials.ForeignSecret as e:
        logger.warning(str(e))
        return
    urls = {
        pod["metadata"]["name"]: stats.stats_url(pod["status"]["podIP"], replica.port)
        for pod in pods
        if pod.get("status", {}).get("podIP") and not pod["metadata"].get("deletionTimestamp")
    }
    token = CONFIG.internal_token.get_secret_value() if CONFIG.internal_token else None
    polled = await stats.poll(urls, CONFIG.stats_timeout, token)
    new_status, restarts = build_status(
        replica=name,
        desired=replica.replicas,
        template_hash=template_hash(replica, CONFIG),
        pods=pods,
        stats=polled,
        previous=dict(status),
        now=_now(),
    )
    patch.status.update(new_status)
    for restart in restarts:
        message = (
            f"member {restart.member} restarted (epoch {restart.old_epoch} -> "
            f"{restart.new_epoch}): its KV cache starts empty"
        )
        logger.info(message)
        kopf.info(body, reason="MemberRestarted", message=message)


@kopf.on.delete(*RESOURCE)
def remove(name: str, namespace: str, uid: str, logger: kopf.Logger, **_: Any) -> None:
    # Owner references would let the garbage collector do this too; deleting here makes
    # the order explicit (members first) and holds the finalizer until it is done.
    try:
        removed = children.remove_children(namespace, name, uid)
        removed += credentials.remove_credentials(namespace, name, uid)
        # After the pods: a member still running loses its NATS user only once it is gone.
        if credentials.sync_nats_users(CONFIG, namespace, name, None):
            logger.info("NATS users updated")
    except ApiException as e:
        raise _api_error(e) from e
    logger.info(f"removed {removed} child object(s)")
