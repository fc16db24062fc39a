"""The sim report stands below the sim CLI: it loads without cachepoint.sim.cli (the
CLI imports the report, so the other way round was a cycle), and its label of what
the product ships is still the CLI's, read from the same product defaults."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_report_loads_without_the_cli() -> None:
    # NOTE: a fresh interpreter, since this suite may already have imported the CLI.
    code = "import sys, cachepoint.sim.report; print('cachepoint.sim.cli' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
        timeout=120,
    )
    assert out.stdout.strip() == "False"


def test_the_shipped_label_is_the_clis_defaults() -> None:
    from cachepoint.sim import cli, report

    assert f"{cli.SHIPPED_POLICY} + {cli.SHIPPED_EVICTION}" == report.SHIPPED
    assert report.SHIPPED_POLICY == cli.SHIPPED_POLICY
    assert report.SHIPPED_EVICTION == cli.SHIPPED_EVICTION
