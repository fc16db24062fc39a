"""`cachepoint-gateway`: serve the Messages API."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cachepoint.serve import serve, settings_from_flags

from .settings import GatewaySettings


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
        metavar="URL",
        help="replica base URL to poll for load; repeat for several (NATS discovers the rest)",
    )
    p.add_argument("--nats-url", help="NATS for kv events and heartbeats (cache-aware routing)")
    p.add_argument("--routing-policy", help="cache_aware (default), least_loaded, round_robin, ...")
    p.add_argument("--model", dest="models", action="append", help="model id served (repeatable)")
    p.add_argument("--model-dir", type=Path, help="tokenizer folder; default: byte tokenizer")
    p.add_argument("--block-size", type=int, help="the replicas' KV block size (default 16)")
    p.add_argument("--min-cacheable-tokens", type=int, help="shorter prefixes are not cached")
    p.add_argument("--log-level", default="info", help="debug | info | warning (default info)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = settings_from_flags(parser, args, GatewaySettings)

    from .app import create_app

    serve(lambda: create_app(settings), settings.host, settings.port, args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
