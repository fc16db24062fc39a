"""kopf handlers for CacheReplica: thin glue between events and the pure builders.

- create / update / resume: check the spec, then the credentials Secret and this
  CacheReplica's users in the NATS users include, then converge the NetworkPolicy
  (before any member exists), the Service, the PodDisruptionBudget and the members
  (rolling within spec.rollout.maxUnavailable); TemporaryError until the roll settles.
- an index of member pods (one watch stream for all of them), so the timer lists none.
- a timer: re-assert the credentials, the NATS users and the NetworkPolicy, heal
  missing and Failed members, poll every member's /v1/stats (with the internal token),
  write status when it changed.
- delete: remove the children and the credentials, drop the NATS users, then kopf
  releases the finalizer; the garbage collector takes the NetworkPolicy after that.
- one pruner per operator (startup to cleanup): drops the NATS users of every
  CacheReplica that is gone or being deleted, whatever wrote them back.

A child create the API refuses (403, 422, ...) is kept in the object's memo and shown
as Degraded=CreateFailed with the API's message, until a later create of that kind
succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from cachepoint.operator import children, credentials, kube, stats
from cachepoint.operator.config import OperatorConfig
from cachepoint.operator.members import Plan
from cachepoint.operator.naming import (
    FINALIZER,
    GROUP,
    LABEL_REPLICA,
    PLURAL,
    VERSION,
    common_labels,
)
from cachepoint.operator.pod import template_hash
from cachepoint.operator.spec import SpecError, check
from cachepoint.operator.status import build_invalid_status, build_status, set_condition

CONFIG = OperatorConfig.from_env()
RESOURCE = (GROUP, VERSION, PLURAL)
MANAGED_BY = "app.kubernetes.io/managed-by"
# What every member pod carries (naming.common_labels): the pod index and its watch
# stream see only those.
MEMBER_LABELS: dict[str, Any] = {
    MANAGED_BY: common_labels("x")[MANAGED_BY],
    LABEL_REPLICA: kopf.PRESENT,
}
PodIndex = kopf.Index[tuple[str, str], dict[str, Any]]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _api_error(e: ApiException) -> kopf.TemporaryError:
    return kopf.TemporaryError(f"Kubernetes API: {e.status} {e.reason}", delay=CONFIG.retry_delay)


TIMER_EXIT_POLL_S = 0.5


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
    # Only our member pods travel on the pods watch stream, not every pod in the cluster.
    settings.watching.label_selectors["v1", "pods"] = f"{MANAGED_BY}={MEMBER_LABELS[MANAGED_BY]}"
    # NOTE: a deletion waits for the status timer to exit, and a tick in flight (polling
    # slow replicas) is re-checked only every `cancellation_polling` seconds: kopf's 60 s
    # default held every such `kubectl delete` (and `helm uninstall`) for a minute.
    settings.background.cancellation_polling = TIMER_EXIT_POLL_S


@kopf.index("v1", "pods", labels=MEMBER_LABELS)
def member_pods(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """Member pods by (namespace, CacheReplica name), kept current by one watch stream."""
    return {(namespace, labels[LABEL_REPLICA]): dict(body)}


def _indexed_pods(index: PodIndex, namespace: str, name: str, uid: str) -> list[dict[str, Any]]:
    """This CacheReplica object's member pods (not an older one's of the same name)."""
    return [p for p in index.get((namespace, name), []) if kube.owned_by(p, uid)]


def _create_failures(memo: kopf.Memo) -> dict[str, str]:
    failures: dict[str, str] = memo.setdefault("create_failures", {})
    return failures


def _report_finished(body: kopf.Body, step: Plan, logger: kopf.Logger) -> None:
    for why in step.failed:
        logger.warning(f"replacing member {why}")
        kopf.warn(body, reason="MemberFailed", message=f"replacing {why}")


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
    memo: kopf.Memo,
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
        # Before the members: none of them ever runs without its ingress policy.
        policy = children.ensure_network_policy(body, name, namespace, CONFIG)
        service = children.ensure_service(body, name, namespace, replica)
        budget = children.ensure_pdb(body, name, namespace, replica)
        step = children.converge_members(body, name, namespace, uid, replica, CONFIG, roll=True)
    except kube.CreateRejected as e:
        _create_failures(memo)[e.kind] = e.message
        conditions = list(status.get("conditions") or [])
        patch.status["phase"] = "Degraded"
        patch.status["conditions"] = set_condition(
            conditions, "Degraded", True, "CreateFailed", e.message, _now()
        )
        kopf.warn(body, reason="CreateFailed", message=e.message)
        # NOTE: the same answer comes back until RBAC, a quota or a policy changes; the
        # timer keeps trying the members meanwhile, this tries everything now and then.
        raise kopf.TemporaryError(e.message, delay=max(60.0, CONFIG.retry_delay)) from e
    except ApiException as e:
        raise _api_error(e) from e
    except (children.ForeignChild, credentials.ForeignSecret) as e:
        # Not ours to fix: say so once per attempt, and look again now and then.
        kopf.warn(body, reason="NameConflict", message=str(e))
        raise kopf.TemporaryError(str(e), delay=max(60.0, CONFIG.retry_delay)) from e
    _create_failures(memo).clear()
    _report_finished(body, step, logger)
    if policy:
        logger.info(f"NetworkPolicy {policy}")
    if service:
        logger.info(f"Service {service}")
    if budget:
        logger.info(f"PodDisruptionBudget {budget}")
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
        # NOTE: kopf runs startup handlers before the login one, so without this the
        # first prune ran on the client's default (or a stale) server and logged a
        # connection-refused traceback at every start.
        await asyncio.to_thread(kube.configure)
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


def _changed(current: kopf.Status, new: dict[str, Any]) -> bool:
    """Whether writing `new` would change status (fields it does not set are kept)."""
    return any(current.get(key) != value for key, value in new.items())


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
    memo: kopf.Memo,
    member_pods: PodIndex,
    **_: Any,
) -> None:
    try:
        replica = check(name, spec)
    except SpecError as e:
        invalid = build_invalid_status(e.problems, dict(status), _now())
        if _changed(status, invalid):
            patch.status.update(invalid)
        return
    # NOTE: from the index, not a LIST: with hundreds of CacheReplicas, two lists per
    # tick each were most of the operator's API load. The index may lag our own last
    # write by one event; this path only heals (creates missing, deletes finished and
    # excess members), and the plan is idempotent against a stale view.
    pods = _indexed_pods(member_pods, namespace, name, uid)
    failures = _create_failures(memo)
    try:
        # Bare pods have no controller but us: put back members that vanished (eviction,
        # node loss, kubectl delete) or failed. Creating and rolling stay with the
        # handlers, so only once they have seen the object (observedGeneration is theirs
        # to write), and never while it is being deleted.
        handled = status.get("observedGeneration") is not None
        if handled and not meta.get("deletionTimestamp"):
            # Level-based: the users include is re-asserted on every tick, so a users
            # Secret that Helm reset or another writer dropped is repaired here.
            passwords = await asyncio.to_thread(
                credentials.ensure_credentials, body, name, namespace, replica.replicas, CONFIG
            )
            failures.pop("Secret", None)
            # NOTE: `meta` is from when this tick began; the object may have been deleted
            # since, and writing its users now would undo the delete handler's removal.
            # Ask again right before writing (the pruner catches what still slips by).
            if await asyncio.to_thread(_still_live, namespace, name, uid):
                await asyncio.to_thread(
                    credentials.sync_nats_users, CONFIG, namespace, name, passwords
                )
                # Level-based too, and before healing members: a policy deleted or
                # widened by hand is put back within a tick, and no member is created
                # while its policy cannot be (the except clauses below skip that).
                policy = await asyncio.to_thread(
                    children.ensure_network_policy, body, name, namespace, CONFIG
                )
                failures.pop("NetworkPolicy", None)
                if policy:
                    logger.info(f"NetworkPolicy {policy}")
                step = await asyncio.to_thread(
                    children.converge_members,
                    body,
                    name,
                    namespace,
                    uid,
                    replica,
                    CONFIG,
                    roll=False,
                    pods=pods,
                )
                failures.pop("Pod", None)
                _report_finished(body, step, logger)
    except kube.CreateRejected as e:
        failures[e.kind] = e.message
        logger.warning(e.message)
    except ApiException as e:
        logger.warning(f"cannot converge members: {e.status} {e.reason}")
        return
    except (children.ForeignChild, credentials.ForeignSecret) as e:
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
        create_failures=sorted(failures.values()),
    )
    # Only on change: an unchanged status written every tick was the other half of the
    # load (one PATCH per CacheReplica per interval, and a watch event back for each).
    if _changed(status, new_status):
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
