"""Request intake: from the raw body to a validated request, off the event loop and
bounded, so that one org's huge body cannot stall another org's call. ``body`` parses
and checks the JSON (sizes, depth, NaN), ``pool`` runs heavy work (parsing, rendering,
tokenizing, fingerprints) in worker threads with a per-org share, ``memory`` hands
freed memory back to the OS after a large body."""

from cachepoint.gateway.intake.body import BodyLimits, read_body
from cachepoint.gateway.intake.memory import trim_after
from cachepoint.gateway.intake.pool import IntakeFull, IntakePool

__all__ = ["BodyLimits", "IntakeFull", "IntakePool", "read_body", "trim_after"]
