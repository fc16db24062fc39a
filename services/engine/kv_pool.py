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
    """Per layer one K and one V tensor, head-major: ``[kv_heads, num_blocks, block_size,
    head_dim]``.

    NOTE: head-major so that the blocks of a block table, gathered along the block
    dimension, come out as ``[kv_heads, tokens, head_dim]``: the layout attention (SDPA)
    reads at full speed. Token-major storage gathered a ``[tokens, kv_heads, head_dim]``
    tensor whose transposed view made the CPU's SDPA kernel about 1.8x slower per
    decode call, the largest cost of a decode step after the weights' matmuls.
    """

    __slots__ = ("_data", "_scratch", "shape")

    def __init__(self, shape: KVPoolShape, device: torch.device) -> None:
        self.shape = shape
        # NOTE: gathers land in two reused buffers instead of fresh tensors: on the CPU
        # every allocation over 32 MiB is a new mmap whose pages fault in one by one,
        # which cost batched decode more than the copy itself.
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        # NOTE: zeros, not empty: padded decode lanes read never-written blocks;
        # masked-out scores still multiply V, and 0 * NaN garbage would be NaN.
        self._data = torch.zeros(
            (
                shape.num_layers,
                2,
                shape.num_kv_heads,
                shape.num_blocks,
                shape.block_size,
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
    def data(self) -> torch.Tensor:
        """The whole pool, ``[layers, 2, kv_heads, num_blocks, block_size, head_dim]``:
        tier copies move blocks along dim 3."""
        return self._data

    @property
    def nbytes(self) -> int:
        return self._data.numel() * self._data.element_size()

    def key(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, kv_heads, head_dim]`` keys of one layer (a view)."""
        return self._data[layer, 0].permute(1, 2, 0, 3)

    def value(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, kv_heads, head_dim]`` values of one layer (a view)."""
        return self._data[layer, 1].permute(1, 2, 0, 3)

    def _slots(self, layer: int, kind: int) -> torch.Tensor:
        """``[kv_heads, num_blocks * block_size, head_dim]``: token slots, flat."""
        s = self.shape
        return self._data[layer, kind].view(s.num_kv_heads, s.num_blocks * s.block_size, s.head_dim)

    def _blocks(self, layer: int, kind: int) -> torch.Tensor:
        """``[kv_heads, num_blocks, block_size * head_dim]``: one row per head and block."""
        s = self.shape
        return self._data[layer, kind].view(s.num_kv_heads, s.num_blocks, s.block_size * s.head_dim)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[tokens, kv_heads, head_dim]`` at flat ``slots`` ``[tokens]``."""
        dtype = self.shape.dtype
        self._slots(layer, 0).index_copy_(1, slots, k.to(dtype).transpose(0, 1))
        self._slots(layer, 1).index_copy_(1, slots, v.to(dtype).transpose(0, 1))

    def head_major(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V as stored, ``[kv_heads, num_blocks, block_size, head_dim]``
        (views): what a paged kernel reads through block tables."""
        return self._data[layer, 0], self._data[layer, 1]

    def segment(self, layer: int, block: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[kv_heads, tokens, head_dim]`` of ``tokens`` slots starting at block
        ``block``'s first, through consecutive blocks: strided views of the pool, no copy."""
        s = self.shape
        blocks = -(-tokens // s.block_size)
        shape = (s.num_kv_heads, blocks * s.block_size, s.head_dim)
        k = self._data[layer, 0, :, block : block + blocks].view(shape)[:, :tokens]
        v = self._data[layer, 1, :, block : block + blocks].view(shape)[:, :tokens]
        return k, v

    def _buffers(self, elements: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat scratch buffers of at least ``elements`` values each."""
        if self._scratch is None or self._scratch[0].numel() < elements:
            s = self.shape
            # Grow with headroom so that slowly growing decode contexts reallocate rarely.
            cap = max(elements, elements + elements // 4, 2 * s.block_size * s.head_dim)
            # NOTE: a normal tensor even when first needed inside inference_mode, so
            # that gathers outside it (tests, tools) may still write into it.
            with torch.inference_mode(False):
                self._scratch = (
                    torch.empty(cap, dtype=s.dtype, device=self.device),
                    torch.empty(cap, dtype=s.dtype, device=self.device),
                )
        return self._scratch

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at flat ``slots`` (any shape ``S``): each ``[*S, kv_heads, head_dim]``.

        The results are views of scratch buffers that the next gather overwrites: use
        them (or copy them) before gathering again.
        """
        flat = slots.reshape(-1)
        n, s = flat.shape[0], self.shape
        kbuf, vbuf = self._buffers(n * s.num_kv_heads * s.head_dim)
        out = (s.num_kv_heads, n, s.head_dim)
        size = n * s.num_kv_heads * s.head_dim
        k = torch.index_select(self._slots(layer, 0), 1, flat, out=kbuf[:size].view(out))
        v = torch.index_select(self._slots(layer, 1), 1, flat, out=vbuf[:size].view(out))
        shape = (*slots.shape, s.num_kv_heads, s.head_dim)
        return k.transpose(0, 1).reshape(shape), v.transpose(0, 1).reshape(shape)

    def gather_blocks(
        self, layer: int, block_table: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, as attention reads them.

        ``block_table`` ``[nb]`` gives ``[kv_heads, nb * block_size, head_dim]``;
        ``[batch, nb]`` gives ``[batch, kv_heads, nb * block_size, head_dim]`` (a view
        with the batch dimension outermost in its strides only). Positions past a
        sequence's length come along with their block: attention masks or slices them.

        NOTE: a row per block rather than per token: one index per ``block_size`` tokens
        and contiguous runs of ``block_size * head_dim`` values, which the CPU copies
        faster than the same bytes gathered token by token. Same scratch-buffer
        contract as :meth:`gather`.
        """
        s = self.shape
        flat = block_table.reshape(-1)
        n = flat.shape[0]
        row = s.block_size * s.head_dim
        size = s.num_kv_heads * n * row
        kbuf, vbuf = self._buffers(size)
        out = (s.num_kv_heads, n, row)
        k = torch.index_select(self._blocks(layer, 0), 1, flat, out=kbuf[:size].view(out))
        v = torch.index_select(self._blocks(layer, 1), 1, flat, out=vbuf[:size].view(out))
        if block_table.dim() == 1:
            shape = (s.num_kv_heads, n * s.block_size, s.head_dim)
            return k.view(shape), v.view(shape)
        batch, nb = block_table.shape
        shape4 = (s.num_kv_heads, batch, nb * s.block_size, s.head_dim)
        return k.view(shape4).transpose(0, 1), v.view(shape4).transpose(0, 1)

    def read_positions(
        self, layer: int, block_table: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V ``[num_tokens, kv_heads, head_dim]`` of positions
        ``0..num_tokens-1`` of a sequence (tests, tools)."""
        table = torch.tensor(list(block_table), dtype=torch.long, device=self.device)
        k, v = self.gather(layer, slot_mapping(table, 0, num_tokens, self.block_size))
        return k.clone(), v.clone()


def slot_mapping(block_table: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Flat slots of positions ``start..end-1`` for a ``[blocks]`` long block table."""
    pos = torch.arange(start, end, dtype=torch.long, device=block_table.device)
    return block_table[pos // block_size] * block_size + pos % block_size
