"""`python -m cachepoint.replica.prestop`: drain the replica in this pod (its preStop hook).

Calls the replica's ``POST /v1/drain``: the replica stops taking requests, announces
it on NATS (the gateway routes elsewhere at once) and answers when its in-flight
requests have finished or ``--timeout`` has passed. The kubelet sends SIGTERM after
the hook returns, and the replica then exits at once (nothing is left to drain).

Exit status: 0 drained; 1 the timeout passed with requests still in flight (the pod
goes on terminating; they are cut); 2 usage error; 3 the replica could not be asked
(unreachable, refused the token, answered something else). Never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import httpx

from cachepoint.replica.schemas import MAX_DRAIN_S

EXIT_DRAINED = 0
EXIT_IN_FLIGHT = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

# NOTE: the replica answers at most timeout_s after the call; this much more covers a
# busy event loop before the client gives up on it.
_ANSWER_MARGIN_S = 10.0
# NOTE: the same variables the replica reads (cachepoint.runtime.serve.shared_env): the pod's
# environment configures both with one entry.
PORT_ENV = "CACHEPOINT_REPLICA_PORT"
TOKEN_ENVS = ("CACHEPOINT_REPLICA_INTERNAL_TOKEN", "CACHEPOINT_INTERNAL_TOKEN")
DEFAULT_PORT = 8100


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= MAX_DRAIN_S:
        raise argparse.ArgumentTypeError(f"{text} is not within 0..{MAX_DRAIN_S:g} seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cachepoint.replica.prestop",
        description=(
            "Drain a Cachepoint replica before it stops (a pod's preStop hook): it takes "
            "no new requests, tells the gateway on NATS, and this waits until its "
            "in-flight requests and streams have finished, or --timeout. Exit status: "
            "0 drained, 1 still in flight at the timeout, 2 usage error, 3 the replica "
            "could not be asked."
        ),
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        required=True,
        metavar="SECONDS",
        help="how long to wait for in-flight requests; keep it under the pod's "
        "terminationGracePeriodSeconds, which this hook's time counts against",
    )
    p.add_argument(
        "--url",
        help=f"the replica's base URL (default http://127.0.0.1:${PORT_ENV}, port "
        f"{DEFAULT_PORT} when unset); the internal token comes from {TOKEN_ENVS[1]} "
        f"(or {TOKEN_ENVS[0]})",
    )
    return p


def _default_url(parser: argparse.ArgumentParser) -> str:
    raw = os.environ.get(PORT_ENV, "").strip() or str(DEFAULT_PORT)
    if not raw.isdigit() or not 0 < int(raw) <= 65535:
        parser.error(f"{PORT_ENV}={raw!r} is not a port; pass --url")
    return f"http://127.0.0.1:{int(raw)}"


def _token() -> str | None:
    for name in TOKEN_ENVS:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300] or f"HTTP {resp.status_code}"


def drain(url: str, timeout_s: float, token: str | None) -> tuple[int, str]:
    """(exit status, one line to print) for a drain of the replica at ``url``."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.post(
            f"{url.rstrip('/')}/v1/drain",
            json={"timeout_s": timeout_s},
            headers=headers,
            timeout=httpx.Timeout(timeout_s + _ANSWER_MARGIN_S, connect=5.0),
        )
    except httpx.HTTPError as exc:
        return EXIT_UNREACHABLE, f"drain: replica at {url} unreachable: {exc!r}"
    except ValueError as exc:  # a malformed --url
        return EXIT_UNREACHABLE, f"drain: bad replica URL {url!r}: {exc}"
    if resp.status_code != 200:
        return EXIT_UNREACHABLE, f"drain: {url} answered {resp.status_code}: {_message(resp)}"
    try:
        body = resp.json()
        drained, in_flight = bool(body["drained"]), int(body["in_flight"])
    except (ValueError, KeyError, TypeError):
        return EXIT_UNREACHABLE, f"drain: {url} answered no drain result: {resp.text[:300]}"
    line = json.dumps({"event": "drain", "url": url, "drained": drained, "in_flight": in_flight})
    return (EXIT_DRAINED if drained else EXIT_IN_FLIGHT), line


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    url = args.url or _default_url(parser)
    code, line = drain(url, args.timeout, _token())
    print(line, file=sys.stdout if code in (EXIT_DRAINED, EXIT_IN_FLIGHT) else sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
