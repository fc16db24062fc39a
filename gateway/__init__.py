"""The gateway: Messages API, cache_control contract, routing, billing."""
