"""Who is calling and what they may do: orgs and API keys, model aliases, rate
limits, idempotency keys."""
