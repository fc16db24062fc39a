"""What a request's entries may pin on vLLM, decided by kvcore's `PinLedger` before the
request is handed to vLLM, and what the retention connector is told.

The order of things (docs/vllm.md, "Retention"):

1. submit: each breakpoint's full blocks are retained in the ledger, ascending, under
   the request's owner; the first refusal (share cap or quota) stops there, as
   `admission.write_entries` does on the torch engine. The granted ones travel to the
   connector in ``kv_transfer_params`` (`pins.PinSpec`).
2. first output: entries past the read are written, except those refused in 1, which
   are reported (``retention_refused``) and billed as plain input, never as a write.
3. request end: vLLM's connector pins each granted entry's blocks until its end + TTL;
   the replica then extends the ledger to its own now + TTL, which is never earlier,
   so the ledger always counts at least what vLLM holds.

NOTE: a request refused or cancelled before its prefill keeps its grant in the ledger
until the TTL (the connector pins nothing for it: it pins only computed prefixes).
That over-counts, never under-counts: the cap and quotas hold against what vLLM pins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cachepoint.kvcore import BlockHash, PinLedger, RetentionOwner, entry_key_at
from cachepoint.replica.admission import AdmissionPlan
from cachepoint.replica.vllm_engine.pins import PARAMS_KEY, PinSpec


@dataclass(slots=True)
class PinPlan:
    """One request's retention on vLLM."""

    owner: RetentionOwner  # whom the blocks are charged to
    specs: list[PinSpec] = field(default_factory=list)  # granted pins, ascending
    grants: list[tuple[list[BlockHash], float]] = field(default_factory=list)  # (hashes, ttl)
    refused_from: int | None = None  # first breakpoint position refused; None = none
    reason: str | None = None  # why, for the report

    def params(self) -> dict[str, Any] | None:
        """The request's ``kv_transfer_params``; None when nothing is pinned."""
        if not self.specs:
            return None
        pins = [{"key": s.key, "blocks": s.blocks, "ttl": s.ttl} for s in self.specs]
        return {PARAMS_KEY: {"pins": pins}}

    def retained(self, position: int) -> bool:
        """May the entry at ``position`` be written (its blocks were granted)?"""
        return self.refused_from is None or position < self.refused_from


def plan_pins(
    ledger: PinLedger, plan: AdmissionPlan, block_size: int, ttl_scale: float = 1.0
) -> PinPlan:
    """Retain every breakpoint's full blocks in the ledger, ascending; stop at the first
    refusal. A breakpoint inside the first block has nothing to pin and is granted."""
    owner = plan.entry_spans[0].owner if plan.entry_spans else RetentionOwner("-")
    pins = PinPlan(owner)
    for span in plan.entry_spans:
        full = span.position // block_size
        if full == 0:
            continue
        hashes = plan.block_hashes[:full]
        ttl = span.ttl_s * ttl_scale
        result = ledger.retain(hashes, ttl, span.owner)
        if not result.ok:
            pins.refused_from, pins.reason = span.position, result.reason
            break
        key = entry_key_at(
            plan.tokens, span.position, plan.block_hashes, block_size, span.extra_keys
        )
        pins.specs.append(PinSpec(str(key), full, ttl))
        pins.grants.append((hashes, ttl))
    return pins


def extend_at_end(ledger: PinLedger, pins: PinPlan) -> None:
    """The request ended: vLLM's pins now run to its end + TTL; the ledger's must not
    end sooner. NOTE: a grant that expired meanwhile (a request longer than its TTL,
    only with a test's ``ttl_scale``) is retained afresh, or refused and left to the
    connector's own deadline."""
    for hashes, ttl in pins.grants:
        ledger.retain(hashes, ttl, pins.owner)
