"""The `cachepoint` command: the embedded stack (`up`), its supervisor, the demos
and `traces`."""
