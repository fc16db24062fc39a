"""`cachepoint-gateway`: serve the Messages API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cachepoint.gateway.observability import requestlog
from cachepoint.gateway.settings import GatewaySettings
from cachepoint.runtime.serve import serve, settings_from_flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cachepoint-gateway",
        description=(
            "Serve Cachepoint's Anthropic-compatible Messages API: cache_control breakpoints, "
            "scope, billing and the usage/cost reports. Flags override CACHEPOINT_GATEWAY_* "
            "environment variables."
        ),
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default 8080)")
    p.add_argument("--db", dest="database_url", help="SQLAlchemy URL of the billing database")
    p.add_argument(
        "--replica",
        dest="replica_urls",
        action="append",
        metavar="[NAME=]URL",
        help=(
            "replica base URL to poll for load; repeat for several (NATS discovers the "
            "rest). NAME=URL also pins the only URL replica NAME may announce"
        ),
    )
    p.add_argument("--nats-url", help="NATS for kv events and heartbeats (cache-aware routing)")
    p.add_argument(
        "--nats-user",
        help="NATS user; its password comes only from CACHEPOINT_NATS_PASSWORD (not a flag)",
    )
    p.add_argument(
        "--replica-url-check",
        choices=["auto", "exact", "k8s-dns", "off"],
        help="which URL a replica may announce (default auto: exact if NAME=URL given, else off)",
    )
    p.add_argument(
        "--max-epoch-skew",
        dest="max_epoch_skew_s",
        type=float,
        help="refuse replica epochs this many seconds in the future (default 60)",
    )
    p.add_argument(
        "--health-interval",
        dest="health_interval_s",
        type=float,
        help="seconds between /readyz polls of each replica; 0 = none (default 2)",
    )
    p.add_argument("--routing-policy", help="cache_aware (default), least_loaded, round_robin, ...")
    p.add_argument("--model", dest="models", action="append", help="model id served (repeatable)")
    p.add_argument(
        "--model-dir",
        type=Path,
        help=(
            "the served checkpoint (HF folder or .gguf file): its tokenizer and chat template; "
            "default: byte tokenizer"
        ),
    )
    p.add_argument("--block-size", type=int, help="the replicas' KV block size (default 16)")
    p.add_argument("--min-cacheable-tokens", type=int, help="shorter prefixes are not cached")
    p.add_argument(
        "--model-profile",
        dest="model_profiles",
        action="append",
        metavar="MODEL:KEY=VALUE",
        help=(
            "one setting of one served model (repeatable): KEY is context_window, "
            "min_cacheable_tokens or stop_token_ids (comma-separated ids), e.g. "
            "smollm2:context_window=8192 or smollm2:stop_token_ids=2,7; unset keys take "
            "the gateway-wide value. Replaces CACHEPOINT_GATEWAY_MODEL_PROFILES (JSON: "
            '{"MODEL": {"context_window": 8192}})'
        ),
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve /metrics on this port, apart from the API (0 = any free port; default off)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        help="debug | info | warning (default info); request lines are logged at any level",
    )
    p.add_argument(
        "--log-format",
        choices=["json", "text"],
        default="json",
        help="stderr log lines: json (one object per line, default) or text",
    )
    return p


def split_replicas(values: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """``--replica`` values: bare URLs, and NAME=URL pairs (a URL has no '=' before
    its scheme's '://')."""
    bare: list[str] = []
    named: dict[str, str] = {}
    for v in values:
        name, sep, url = v.partition("=")
        if sep and "://" not in name:
            named[name] = url
        else:
            bare.append(v)
    return bare, named


PROFILE_KEYS = ("context_window", "min_cacheable_tokens", "stop_token_ids")


def split_profiles(values: Sequence[str]) -> dict[str, dict[str, object]]:
    """``--model-profile`` values as ``{model: {key: value}}``; values stay strings
    (pydantic checks them). Raises ``ValueError`` naming a malformed one. NOTE: the
    model is split off at the last ':' before '=', so ids such as ``llama3:8b`` work."""
    out: dict[str, dict[str, object]] = {}
    for v in values:
        left, eq, value = v.partition("=")
        model, colon, key = left.rpartition(":")
        key = key.replace("-", "_")
        if not (eq and colon and model):
            raise ValueError(f"--model-profile {v!r}: expected MODEL:KEY=VALUE")
        if key not in PROFILE_KEYS:
            raise ValueError(
                f"--model-profile {v!r}: unknown key {key!r} (one of {', '.join(PROFILE_KEYS)})"
            )
        parsed: object = [x.strip() for x in value.split(",") if x.strip()]
        out.setdefault(model, {})[key] = parsed if key == "stop_token_ids" else value
    return out


def parse(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, GatewaySettings]:
    """Flags (over the environment) to settings; a bad one exits with a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_profiles:
        try:
            args.model_profiles = split_profiles(args.model_profiles)
        except ValueError as exc:
            parser.error(str(exc))
    if args.replica_urls:
        args.replica_urls, named = split_replicas(args.replica_urls)
        args.replicas = named or None
    return args, settings_from_flags(parser, args, GatewaySettings)


def main(argv: Sequence[str] | None = None) -> int:
    args, settings = parse(argv)
    requestlog.always_log()  # one line per Messages request, whatever --log-level says
    # NOTE: here, not at the top: start-up time. The app (FastAPI, the database layer,
    # the request path) doubles the command's imports; --help and a usage error need
    # none of it.
    from cachepoint.gateway.app import create_app

    serve(
        lambda: create_app(settings),
        settings.host,
        settings.port,
        args.log_level,
        log_format=args.log_format,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
