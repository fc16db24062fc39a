"""Wire schemas of the public API."""
