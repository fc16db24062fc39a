"""One KV block's host-side metadata. The KV itself lives in the engine's tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from .hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    """Metadata for one physical block of ``block_size`` token slots.

    States (contract §3): *active* when ``ref_cnt > 0``; *cached-free* when
    ``ref_cnt == 0`` and ``block_hash`` is set (hittable); *empty* when ``ref_cnt == 0``
    and ``block_hash is None`` (free memory).
    """

    block_id: int  # index into the engine's KV tensors; never changes
    ref_cnt: int = 0  # running requests holding this block
    block_hash: BlockHash | None = None  # set only while the block is in the hash index
    retained_until: float = 0.0  # TTL retention deadline (clock seconds); 0.0 = not retained
    retained_by: str | None = None  # owner key charged for the retention; None = not retained
    hits: int = 0  # prefix hits since the block was last filled; eviction strategies read it
    # Intrusive links of the free queue; None while the block is not in it.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)
