"""`cachepoint-operator`: run the CacheReplica operator (kopf) in one process.

cachepoint-operator --namespace ml-serving          # one or more namespaces
cachepoint-operator --all-namespaces --liveness http://0.0.0.0:8080/healthz
"""

from __future__ import annotations

import argparse
import secrets
import sys
from dataclasses import dataclass, field

import kopf


@dataclass(frozen=True)
class RunOptions:
    namespaces: list[str] = field(default_factory=list)
    clusterwide: bool = False
    standalone: bool = True
    peering_name: str | None = None
    priority: int = 0
    liveness_endpoint: str | None = None
    verbose: bool = False
    debug: bool = False
    quiet: bool = False
    log_format: str = "full"


def parse_args(argv: list[str] | None = None) -> RunOptions:
    parser = argparse.ArgumentParser(
        prog="cachepoint-operator",
        description="Reconcile CacheReplica objects (cachepoint.dev/v1alpha1) into GPU pods, "
        "a Service and status. Settings for member pods come from CACHEPOINT_OPERATOR_* env: "
        "NATS_URL, OTLP_ENDPOINT, STATS_INTERVAL, STATS_TIMEOUT, RETRY_DELAY, INTERNAL_TOKEN, "
        "NATS_USERS_SECRET, RELEASE_NAMESPACE.",
    )
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "-n",
        "--namespace",
        action="append",
        dest="namespaces",
        metavar="NAME",
        help="watch this namespace (repeat for several); needs only namespaced RBAC",
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="coordinate with other operator instances through this KopfPeering "
        "(needs kopf's peering CRDs); by default one instance runs standalone",
    )
    parser.add_argument(
        "--priority",
        type=int,
        metavar="N",
        help="this instance's peering priority: the highest one works, the others stand by "
        "(default with --peering: random in 1..32767, so that two replicas never tie)",
    )
    parser.add_argument(
        "-L",
        "--liveness",
        metavar="URL",
        help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("-d", "--debug", action="store_true", help="log kopf's internals too")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    parser.add_argument(
        "--log-format",
        choices=[f.name.lower() for f in kopf.LogFormat],
        default="full",
        help="log line format (json for log collectors)",
    )
    args = parser.parse_args(argv)
    if args.priority is not None and args.peering is None:
        parser.error("--priority needs --peering")
    priority = args.priority
    if priority is None:
        # NOTE: kopf pauses every instance whose priority ties the highest one, so two
        # replicas with the same default would both stand by forever (kopf's docs
        # suggest --priority=$RANDOM for the same reason).
        priority = 1 + secrets.randbelow(32767) if args.peering is not None else 0
    return RunOptions(
        namespaces=list(args.namespaces or []),
        clusterwide=args.all_namespaces,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=priority,
        liveness_endpoint=args.liveness,
        verbose=args.verbose,
        debug=args.debug,
        quiet=args.quiet,
        log_format=args.log_format,
    )


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    kopf.configure(
        verbose=options.verbose,
        debug=options.debug,
        quiet=options.quiet,
        log_format=kopf.LogFormat[options.log_format.upper()],
    )
    # NOTE: imported here, after logging is set up: importing registers the handlers
    # in kopf's global registry, which only the process that runs the operator does.
    from cachepoint.operator import handlers  # noqa: F401

    kopf.run(
        clusterwide=options.clusterwide,
        namespaces=options.namespaces,
        standalone=options.standalone,
        peering_name=options.peering_name,
        priority=options.priority,
        liveness_endpoint=options.liveness_endpoint,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
