"""The environment a user sets to point Claude Code at Cachepoint: one definition for
the client tests (tests/clients/harness.py) and bench/claude_code_bench.py, so the
bench runs the CLI exactly as the tests do."""

from __future__ import annotations

import os
from pathlib import Path


def claude_env(base_url: str, api_key: str, home: Path, context_window: int) -> dict[str, str]:
    """What a user exports to point Claude Code at Cachepoint, and nothing of this
    machine's own: a fresh HOME, no inherited ANTHROPIC_* and no traffic but the API."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TMPDIR": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        # Claude Code cannot know a gateway model's window; this is its documented knob.
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(context_window),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
