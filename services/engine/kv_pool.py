"""The paged KV pool: fixed blocks of ``block_size`` token slots, addressed by block id.

Block ids are kvcore's block ids (``0..num_blocks-1``). A sequence is a block table:
token position ``p`` lives in block ``block_table[p // block_size]`` at slot
``p % block_size``, i.e. at flat slot ``block_table[p // B] * B + p % B``. The pool
knows nothing about which blocks are in use: kvcore's ``BlockPool`` owns that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class KVBudgetError(ValueError):
    """The memory budget cannot hold the minimum number of KV blocks."""


@dataclass(slots=True, frozen=True)
class KVPoolShape:
    """Geometry of one rank's pool."""

    num_layers: int  # one K and one V tensor per layer
    num_blocks: int  # block ids 0..num_blocks-1
    block_size: int  # token slots per block
    num_kv_heads: int  # heads stored on this rank (all of them without TP)
    head_dim: int  # per-head width
    dtype: torch.dtype  # storage dtype

    @property
    def bytes_per_block(self) -> int:
        return block_bytes(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )


def block_bytes(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across all layers, K and V."""
    width = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * width


def blocks_for_budget(budget_bytes: int, bytes_per_block: int, min_blocks: int) -> int:
    """How many whole blocks fit in ``budget_bytes``; at least ``min_blocks`` or an error."""
    num_blocks = max(0, budget_bytes) // bytes_per_block
    if num_blocks < min_blocks:
        raise KVBudgetError(
            f"KV budget of {budget_bytes / 2**20:.1f} MiB holds {num_blocks} blocks of "
            f"{bytes_per_block} bytes, but at least {min_blocks} are needed "
            f"({min_blocks * bytes_per_block / 2**20:.1f} MiB) to fit one sequence of the "
            "maximum length; raise the budget or lower max_model_len"
        )
    return num_blocks


def cuda_kv_budget(
    free_before_load: int, utilization: float, weight_bytes: int, activation_reserve: int
) -> int:
    """Bytes left for KV on a GPU: the allowed share of the memory that was free before
    the weights were loaded, minus the weights and a reserve for one forward's
    activations."""
    return int(free_before_load * utilization) - weight_bytes - activation_reserve


class KVPool:
    """Per layer one K and one V tensor ``[num_blocks, block_size, kv_heads, head_dim]``."""

    __slots__ = ("_data", "_scratch", "shape")

    def __init__(self, shape: KVPoolShape, device: torch.device) -> None:
        self.shape = shape
        # NOTE: gathers land in two reused buffers instead of fresh tensors: on the CPU
        # every allocation over 32 MiB is a new mmap whose pages fault in one by one,
        # which cost batched decode more than the copy itself.
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        # NOTE: zeros, not empty: padded decode lanes gather slot 0 of never-written
        # blocks; masked-out scores still multiply V, and 0 * NaN garbage would be NaN.
        self._data = torch.zeros(
            (
                shape.num_layers,
                2,
                shape.num_blocks,
                shape.block_size,
                shape.num_kv_heads,
                shape.head_dim,
            ),
            dtype=shape.dtype,
            device=device,
        )

    @property
    def num_blocks(self) -> int:
        return self.shape.num_blocks

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    @property
    def device(self) -> torch.device:
        return self._data.device

    @property
    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()

    def key(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, kv_heads, head_dim]`` keys of one layer (a view)."""
        return self._data[layer, 0]

    def value(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, kv_heads, head_dim]`` values of one layer (a view)."""
        return self._data[layer, 1]

    def _flat(self, layer: int, kind: int) -> torch.Tensor:
        s = self.shape
        return self._data[layer, kind].view(s.num_blocks * s.block_size, s.num_kv_heads, s.head_dim)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[tokens, kv_heads, head_dim]`` at flat ``slots`` ``[tokens]``."""
        self._flat(layer, 0).index_copy_(0, slots, k.to(self.shape.dtype))
        self._flat(layer, 1).index_copy_(0, slots, v.to(self.shape.dtype))

    def _buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scratch is None or self._scratch[0].shape[0] < rows:
            s = self.shape
            # Grow with headroom so that slowly growing decode contexts reallocate rarely.
            cap = max(rows, rows + rows // 4, 2 * s.block_size)
            # NOTE: a normal tensor even when first needed inside inference_mode, so
            # that gathers outside it (tests, tools) may still write into it.
            with torch.inference_mode(False):
                self._scratch = (
                    torch.empty(
                        (cap, s.num_kv_heads, s.head_dim), dtype=s.dtype, device=self.device
                    ),
                    torch.empty(
                        (cap, s.num_kv_heads, s.head_dim), dtype=s.dtype, device=self.device
                    ),
                )
        return self._scratch

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at flat ``slots`` (any shape ``S``): each ``[*S, kv_heads, head_dim]``.

        The results are views of scratch buffers that the next ``gather`` overwrites:
        use them (or copy them) before gathering again.
        """
        flat = slots.reshape(-1)
        n, s = flat.shape[0], self.shape
        kbuf, vbuf = self._buffers(n)
        out_shape = (*slots.shape, s.num_kv_heads, s.head_dim)
        k = torch.index_select(self._flat(layer, 0), 0, flat, out=kbuf[:n])
        v = torch.index_select(self._flat(layer, 1), 0, flat, out=vbuf[:n])
        return k.view(out_shape), v.view(out_shape)

    def read_positions(
        self, layer: int, block_table: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of positions ``0..num_tokens-1`` of a sequence (tests, tools)."""
        table = torch.tensor(list(block_table), dtype=torch.long, device=self.device)
        k, v = self.gather(layer, slot_mapping(table, 0, num_tokens, self.block_size))
        return k.clone(), v.clone()


def slot_mapping(block_table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat slots of positions ``start..end-1`` for a ``[blocks]`` long block table."""
    pos = torch.arange(start, end, dtype=torch.long, device=block_table.device)
    return block_table[pos // block_size] * block_size + pos % block_size
