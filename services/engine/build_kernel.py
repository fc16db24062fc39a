"""``python -m cachepoint.engine.build_kernel``: build the engine's CPU attention
kernel ahead of time (``make install`` and the replica image run it), or say why this
machine cannot use it. See :mod:`.cpu_kernels`."""

from __future__ import annotations

import argparse
import sys
import time

from cachepoint.engine.cpu_kernels import build, library_path, why_unavailable


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cachepoint.engine.build_kernel",
        description="Build the engine's CPU attention kernel ahead of time (make install "
        "and the replica image do), or say why this machine cannot use it.",
    )
    ap.add_argument("--check", action="store_true", help="only report; build nothing")
    ap.add_argument("--verbose", action="store_true", help="show the compiler's output")
    ap.add_argument(
        "--any-cpu",
        action="store_true",
        help="build even where this CPU cannot run it (an image built for other nodes)",
    )
    args = ap.parse_args(argv)
    why = why_unavailable()
    if why is not None and args.any_cpu and sys.platform == "linux":
        why = None
    if why is not None:
        print(f"CPU attention kernel: not used here ({why}); torch's kernels serve instead")
        return 0
    path = library_path()
    if path.exists():
        print(f"CPU attention kernel: built ({path})")
        return 0
    if args.check:
        print(f"CPU attention kernel: not built yet (would build into {path.parent})")
        return 0
    t0 = time.monotonic()
    print(f"CPU attention kernel: building into {path.parent} ...", flush=True)
    try:
        build(verbose=args.verbose)
    except Exception as exc:
        print(f"CPU attention kernel: build failed: {exc}", file=sys.stderr)
        return 1
    print(f"CPU attention kernel: built in {time.monotonic() - t0:.0f} s ({path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
