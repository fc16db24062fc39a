"""Measured speeds the router prices lower-tier hits with (reported in heartbeats)."""

from __future__ import annotations

from dataclasses import dataclass

_ALPHA = 0.2  # weight of the newest sample in each moving average


def _ewma(old: float, new: float) -> float:
    return new if old <= 0.0 else (1 - _ALPHA) * old + _ALPHA * new


@dataclass(slots=True)
class Rates:
    """Exponential moving averages; 0.0 until first measured ("not reported").

    NOTE: per device, as the router compares them per device: each TP rank copies its
    own shard of every block in parallel with the others.
    """

    prefill_tokens_per_s: float = 0.0  # prompt tokens computed per second of prefill steps
    host_bytes_per_s: float = 0.0  # tier copies that touched only device and host memory
    disk_bytes_per_s: float = 0.0  # tier copies that read or wrote the disk tier

    def prefill(self, tokens: int, seconds: float) -> None:
        # NOTE: a step's whole time is charged to its prefill tokens, decodes included,
        # so the rate errs low: a lower-tier hit is then priced a little too cheaply
        # against recompute, never too dearly.
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, tokens / seconds)

    def copies(self, nbytes: int, seconds: float, *, disk: bool) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        if disk:
            self.disk_bytes_per_s = _ewma(self.disk_bytes_per_s, rate)
        else:
            self.host_bytes_per_s = _ewma(self.host_bytes_per_s, rate)
