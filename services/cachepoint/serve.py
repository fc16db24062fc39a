"""What every service command does after parsing its flags: settings, logging, uvicorn."""

from __future__ import annotations

import argparse
import gc
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def settings_from_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cls: type[S]
) -> S:
    """Flags that were given override the environment; a bad value is a usage error
    naming the setting, never a traceback."""
    given = {k: v for k, v in vars(args).items() if v is not None and k != "log_level"}
    try:
        return cls(**given)
    except ValidationError as exc:
        parser.error("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))


def serve(app_factory: Callable[[], Any], host: str, port: int, log_level: str) -> None:
    """Run the app with uvicorn, which turns SIGINT/SIGTERM into a graceful shutdown
    (the app's lifespan then drains what it owns)."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    app = app_factory()
    # NOTE: what is alive now (the model, the schemas, the routes) lives as long as the
    # process. Frozen, the collector stops re-scanning it: on the replica a full
    # collection otherwise stalls a request for about 0.2 s every few dozen requests.
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level=log_level)
