"""The gateway's view of the fleet: the replica directory fed by NATS, trust in
announced URLs, routing, and the HTTP client that streams from a replica."""
