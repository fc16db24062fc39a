"""Package layout only; everything else is in pyproject.toml.

The folders are laid out by role (services/, gateway/, operator/) but import under
one namespace, ``cachepoint``. This maps each folder to its package and lists every
subpackage found under it, so a new module needs no packaging edit. There is no
importable top-level ``operator``: it would shadow the standard library.
"""

from __future__ import annotations

import os

from setuptools import setup

PACKAGE_DIRS = {
    "cachepoint": "services/cachepoint",
    "cachepoint.kvcore": "services/kvcore",
    "cachepoint.billing": "services/billing",
    "cachepoint.protocol": "services/protocol",
    "cachepoint.tokenizer": "services/tokenizer",
    "cachepoint.engine": "services/engine",
    "cachepoint.replica": "services/replica",
    "cachepoint.runtime": "services/runtime",
    "cachepoint.embedded": "services/embedded",
    "cachepoint.routing": "services/routing",
    "cachepoint.events": "services/events",
    "cachepoint.telemetry": "services/telemetry",
    "cachepoint.sim": "services/sim",
    "cachepoint.gateway": "gateway",
    "cachepoint.operator": "operator",
    # NOTE: the benchmarks, so tests and bench scripts share helpers by import (never
    # by path or sys.path); images copy no bench/, and a missing folder maps nothing.
    "cachepoint.bench": "bench",
}


def _packages() -> list[str]:
    found = []
    for name, root in PACKAGE_DIRS.items():
        for folder, _dirs, files in os.walk(root):
            if "__init__.py" in files:
                rel = os.path.relpath(folder, root)
                found.append(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    return sorted(found)


setup(
    package_dir={k: v for k, v in PACKAGE_DIRS.items() if os.path.isdir(v)},
    packages=_packages(),
)
