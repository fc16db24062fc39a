"""The process runtime the services share: server start-up, signals, logging."""
