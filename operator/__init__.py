"""The kopf operator that turns each CacheReplica into replica pods, a Service and status.

Imports only kopf, kubernetes, httpx, pydantic and its own modules: the operator image
carries no service code. See docs/deploy.md and docs/contract.md §6.
"""
