"""The replica: its internal API over a core that schedules requests onto one engine
(the torch engine, or vLLM's)."""
