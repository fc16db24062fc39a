"""The gateway's metrics, request log and tracing set-up."""
