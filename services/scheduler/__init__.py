"""The replica scheduler."""
