"""The suite's grouping reaches xdist's scheduler (tests/conftest.py).

pytest 9.2 with pytest-xdist 3.8 dropped it silently (pytest-xdist#1386): every module
was spread over both workers and the vLLM replica started twice, minutes of `make test`.
"""

from __future__ import annotations

import os

import pytest


def test_a_loadgroup_run_carries_this_modules_group(request: pytest.FixtureRequest) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None or not request.config.getvalue("loadgroup"):
        pytest.skip("not a `--dist loadgroup` worker: nothing is scheduled by group")
    assert request.node.nodeid.endswith("@tests/test_xdist_groups.py"), request.node.nodeid
