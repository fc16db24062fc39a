"""Suite-wide settings."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# NOTE: CI must run at least as many examples as a developer does; "ci" also
# removes the deadline because a shared 2-core runner has noisy timings.
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
