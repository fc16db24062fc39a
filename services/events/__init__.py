"""The event plane: the wire schema of kv events, heartbeats and snapshots, and the
NATS helpers both sides use. Imports kvcore only for the event types it converts."""
