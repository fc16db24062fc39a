"""The `cachepoint` command: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cachepoint.embedded.kvcore_demo import run_demo
from cachepoint.embedded.traces_cmd import add_traces_parser, run_traces
from cachepoint.embedded.up import add_up_parser, run_up
from cachepoint.sim.cli import add_sim_parser, run_sim_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachepoint",
        description=(
            "Cachepoint: prefix KV caching as a managed API contract "
            "(TTL retention, scope, billing, cache-aware routing)."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="walk through the KV block core: hits, TTL retention, eviction, scope",
        description=(
            "Runs kvcore on a small in-memory pool with a simulated clock and prints "
            "what the cache does at each step. Needs no network, GPU or cluster."
        ),
    )
    demo.add_argument("--blocks", type=int, default=64, help="pool size in blocks (default 64)")
    demo.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    add_sim_parser(sub)
    add_up_parser(sub)
    add_traces_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.blocks < 8 or args.block_size < 1:
            parser.error("--blocks must be at least 8 and --block-size at least 1")
        return run_demo(num_blocks=args.blocks, block_size=args.block_size)
    if args.command == "sim":
        return run_sim_command(args, parser)
    if args.command == "traces":
        return run_traces(args, parser)
    if args.command == "up":
        return run_up(args, parser)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
