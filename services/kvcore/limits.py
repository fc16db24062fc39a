"""The most one request may ask of the cache: what bounds its hashing and entry work.

The replica's API refuses a request past these (the wire schema in cachepoint.protocol
imports them), so a request cannot make the replica hash under unbounded keys or look
up unbounded entries. The lookback bound is the manager's ``MAX_LOOKBACK_BOUNDARIES``.
"""

from __future__ import annotations

MAX_BREAKPOINTS = 4
"""Breakpoints (managed entries looked up and written) per request: Anthropic's limit."""

MAX_KEY_SPANS = 8
"""Key spans per request: the extra-key schedule's changes along the prompt."""

MAX_EXTRA_KEYS = 16
"""Extra keys in one key span (hashed into every block the span covers)."""
