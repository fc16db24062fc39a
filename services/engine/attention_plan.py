"""Which K/V each sequence of a step reads, planned once per step on the host.

A step's tokens are packed into one ``[tokens, ...]`` batch: every prefill's computed
tokens first, then one token per decoding sequence. The plan says, per sequence, where
its context lives in the pool, as pieces attention can read without copying:

- a :class:`Segment` is a run of consecutive pool blocks (possibly ending mid-block),
  one strided view of the pool, read in place;
- blocks in runs shorter than :data:`MIN_RUN` are cheaper to copy than to visit one
  call at a time, so they are gathered, all of a sequence's at once;
- a decode batch's leading blocks that every lane shares (a common system prompt) are
  read once for the whole batch, with every lane's query against them (cascade
  attention), instead of once per lane;
- a decode lane's runs a few foreign blocks apart (a cached prefix, then the blocks
  allocated after it) are one view with those blocks masked out: one kernel call
  instead of two and a merge.

Attention over a set of keys does not depend on their order, so the pieces of one
sequence may be attended separately and merged by their log-sum-exp.

The plan is built from :class:`~.block_tables.SeqTable` runs, so host work per step is
linear in the batch and the number of runs, not in the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachepoint.engine.block_tables import Run, SeqTable, shared_blocks

# NOTE: a run shorter than this many blocks is gathered rather than read in place. One
# extra CPU flash call costs about 15 us of overhead; copying a 16-token block of a
# small model's K and V costs well under 1 us. Measured on the tiny model and on
# SmolLM2 shapes, runs of 8+ blocks (128 tokens) are cheaper to visit than to copy.
MIN_RUN = 8

# NOTE: a decode lane whose private blocks form more runs than this is gathered whole
# by one tensor slice instead of being split run by run in Python.
MAX_SPLIT_RUNS = 8

# NOTE: a decode lane's runs separated by a few foreign blocks are read as one view,
# the foreign slots masked out, when those blocks' K/V (per layer) are at most this many
# bytes, and fewer than the lane's own blocks in the view. A cached prefix followed by
# the blocks allocated after it is the common case: two runs with a small gap. Measured
# here, a CPU flash call over 16 keys costs about 25 us, and streaming K/V about
# 15 ns a key on the tiny model, 180 ns on SmolLM2's shapes and 740 ns on Llama-3-8B's
# (about 10 GB/s): 256 KiB of hidden K/V cost what the second call and its merge save.
BRIDGE_BYTES = 256 << 10


def bridge_limit(layer_block_bytes: int) -> int:
    """How many foreign blocks one view may hide, for blocks of ``layer_block_bytes``
    (K and V of one layer)."""
    return BRIDGE_BYTES // max(1, layer_block_bytes)


@dataclass(slots=True)
class Segment:
    """Token slots of consecutive pool blocks, read in place."""

    block: int  # first pool block id
    tokens: int  # slots from its first slot on (the last block may be partly used)
    # [1, 1, 1, tokens] float 0 / -inf hiding foreign blocks inside the view, or None
    bias: torch.Tensor | None = None


@dataclass(slots=True)
class PrefillSpan:
    """One prefilling sequence's rows in the packed batch, and its cached context."""

    start: int  # first packed row (its token is at position num_cached)
    end: int  # one past the last packed row
    length: int  # N: the context attended over, positions 0..N-1
    segments: list[Segment]  # cached positions read in place
    gathered: torch.Tensor | None  # [g] pool ids of cached full blocks to copy, or None
    # int32 [ceil(length / block_size)] pool ids of the whole context (a view of the
    # table's persistent row), for a kernel that reads the table itself; CPU only
    block_ids: torch.Tensor | None = None

    @property
    def num_cached(self) -> int:
        """M: the cached positions before the first computed row."""
        return self.length - (self.end - self.start)


@dataclass(slots=True)
class DecodeSpan:
    """All decoding sequences: the last ``batch`` rows of the packed batch."""

    start: int  # first decode row; decode rows run to the end of the batch
    batch: int  # number of decoding sequences
    shared: list[Segment]  # full blocks every lane shares, read once for all lanes
    lane_segments: list[tuple[int, Segment]]  # (lane, run) private long runs read in place
    rest: torch.Tensor | None  # [batch, P] pool ids lanes gather (short runs), or None
    rest_bias: torch.Tensor | None  # [batch, 1, 1, P * block_size] float 0 / -inf
    rest_empty: torch.Tensor | None  # [batch] bool: lanes with nothing in `rest`
    # With a kernel that reads block tables itself (CPU, :func:`plan_decode`'s
    # ``paged``), the lanes' keys after the shared blocks come from these instead of
    # lane_segments and rest, which stay empty:
    tables: torch.Tensor | None = None  # int32 [batch, width] each lane's pool ids
    lengths: torch.Tensor | None = None  # int64 [batch] keys each lane attends
    key_start: int = 0  # first key the tables are read from (the shared blocks' end)


@dataclass(slots=True)
class VarlenMetadata:
    """The step as a paged varlen kernel reads it (CUDA): one row of each per sequence,
    prefills first, then decodes."""

    cu_seqlens_q: torch.Tensor  # int32 [seqs + 1] query row offsets
    seq_lens: torch.Tensor  # int32 [seqs] keys each sequence attends (cached + new)
    block_tables: torch.Tensor  # int32 [seqs, max_blocks], padded with 0
    max_q: int  # most query rows of one sequence
    max_k: int  # most keys of one sequence


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's packed batch."""

    slot_mapping: torch.Tensor  # [tokens] where each packed row's new K/V is written
    prefills: list[PrefillSpan]  # in packed order
    decode: DecodeSpan | None  # None when the step has no decoding sequences
    varlen: VarlenMetadata | None = None  # set when a paged kernel reads the tables itself


def plan_varlen(
    tables: list[SeqTable], rows: list[int], lengths: list[int], device: torch.device
) -> VarlenMetadata:
    """Kernel metadata for sequences with ``rows`` queries over ``lengths`` keys.

    NOTE: the block table is copied from each table's persistent int32 row (a memcpy
    per sequence, no per-block Python), then moved to the device in one transfer.
    """
    width = max(len(t.blocks) for t in tables)
    host = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        host[i, : len(t.blocks)] = t.ids[: len(t.blocks)]
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(rows, dtype=torch.int32), 0, out=cu[1:])
    return VarlenMetadata(
        cu.to(device),
        torch.tensor(lengths, dtype=torch.int32).to(device),
        host.to(device),
        max(rows),
        max(lengths),
    )


def _split(
    runs: list[Run],
    block_size: int,
    gaps: list[list[tuple[int, int]]] | None = None,
    device: torch.device | None = None,
) -> tuple[list[Segment], list[int]]:
    """Long runs as segments, the blocks of short ones as a gather list; with ``gaps``
    (from :func:`_bridge`, one list per run), a joined run's view masks its gaps."""
    segments: list[Segment] = []
    gathered: list[int] = []
    for i, r in enumerate(runs):
        if r.count >= MIN_RUN:  # a joined run always is
            n = r.count * block_size
            bias = None if gaps is None else _gap_bias(gaps[i], n, block_size, device)
            segments.append(Segment(r.block, n, bias))
        else:
            gathered.extend(range(r.block, r.block + r.count))
    return segments, gathered


def _bridge(runs: list[Run], limit: int) -> tuple[list[Run], list[list[tuple[int, int]]]]:
    """Runs joined across gaps of foreign blocks, at most ``limit`` hidden blocks a
    view: each joined run spans its pieces' pool blocks, and its gaps list the hidden
    ``(offset, blocks)`` inside it, offsets in blocks from the run's first block.

    NOTE: only a run that ascends in the pool joins the one before it, and only when
    the joined run comes out at least ``MIN_RUN`` long, so it is always read in place
    (never gathered: the gaps are other sequences' blocks).
    """
    out: list[Run] = []
    gaps: list[list[tuple[int, int]]] = []
    for r in runs:
        if out:
            prev, hidden = out[-1], gaps[-1]
            end = prev.block + prev.count
            gap = r.block - end
            joined = r.block + r.count - prev.block
            total = sum(n for _, n in hidden) + gap
            if gap > 0 and total <= limit and joined >= MIN_RUN and 2 * total < joined:
                hidden.append((end - prev.block, gap))
                prev.count = joined
                continue
        out.append(Run(r.first, r.block, r.count))
        gaps.append([])
    return out, gaps


def _gap_bias(
    gaps: list[tuple[int, int]], tokens: int, block_size: int, device: torch.device | None
) -> torch.Tensor | None:
    if not gaps:
        return None
    bias = torch.zeros(1, 1, 1, tokens, device=device)
    for offset, blocks in gaps:
        bias[..., offset * block_size : (offset + blocks) * block_size] = float("-inf")
    return bias


def plan_prefill(
    table: SeqTable,
    start: int,
    end: int,
    num_cached: int,
    length: int,
    block_size: int,
    device: torch.device,
) -> PrefillSpan:
    """The span of a prefill computing positions ``num_cached..length-1``."""
    full, tail = divmod(num_cached, block_size)
    runs = table.span(0, full + (1 if tail else 0))
    last = runs.pop() if tail else None
    segments, gathered = _split(runs, block_size)
    if last is not None:
        # NOTE: the partly cached block is read through its first `tail` slots only;
        # this step writes the rest of it, which the view never reaches. It extends
        # the run it continues, or stands alone: never gathered, never a merge more.
        if last.count > 1 and last.count - 1 >= MIN_RUN:
            segments.append(Segment(last.block, (last.count - 1) * block_size + tail))
        else:
            gathered.extend(range(last.block, last.block + last.count - 1))
            segments.append(Segment(last.block + last.count - 1, tail))
    ids = None
    if gathered:
        ids = torch.tensor(gathered, dtype=torch.long, device=device)
    block_ids = table.ids[: -(-length // block_size)] if device.type == "cpu" else None
    return PrefillSpan(start, end, length, segments, ids, block_ids)


def plan_decode(
    tables: list[SeqTable],
    positions: list[int],
    start: int,
    block_size: int,
    device: torch.device,
    bridge: int = 0,
    paged: bool = False,
) -> tuple[DecodeSpan, list[int]]:
    """The decode span, and each lane's write slot, for lanes at ``positions``;
    ``bridge`` foreign blocks at most may be masked inside one view (:func:`bridge_limit`).
    With ``paged``, the lanes' own keys are left to a kernel that reads their tables.

    Lane ``i`` attends positions ``0..positions[i]``: its full blocks
    ``0..positions[i] // block_size - 1`` and the first slots of its current block,
    where this step writes its token. A lane whose current block continues a long run
    reads it as part of that run: a lone sequence in a fresh pool is then one view and
    one kernel call per layer, with nothing gathered and nothing merged.
    """
    full = [p // block_size for p in positions]
    shared = min(full) if len(tables) > 1 else 0
    head = tables[0]
    for t in tables[1:]:
        if shared == 0:
            break
        shared = shared_blocks(head, t, shared)
    shared_segments: list[Segment] = []
    lead = 0  # the shared blocks read by the cascade: its leading long runs
    for r in head.span(0, shared):
        # NOTE: the cascade reads each run with one attention call (and a merge), for
        # every layer of every step. A shared prefix allocated from a pool that earlier
        # traffic left in LRU order lies in runs of a block or two: 100+ calls a layer
        # took a 4-lane SmolLM2 decode from 60 to 210 ms a token. From its first short
        # run on, the prefix is read with each lane's own blocks instead (by the kernel,
        # or runs and gathers), which costs one more read of those blocks per lane.
        if r.count < MIN_RUN:
            break
        shared_segments.append(Segment(r.block, r.count * block_size))
        lead += r.count
    shared = lead
    if paged:
        return _plan_paged_decode(tables, positions, start, block_size, shared, shared_segments)
    lane_segments: list[tuple[int, Segment]] = []
    rest: list[torch.Tensor] = []
    valid: list[int] = []
    slots: list[int] = []
    for lane, (t, f, p) in enumerate(zip(tables, full, positions, strict=True)):
        used = p % block_size + 1  # slots of the current block this lane attends
        if t.run_count(shared, f + 1) > MAX_SPLIT_RUNS:
            # NOTE: a fragmented table (blocks handed out while many lanes grew at once)
            # is gathered whole, straight from its persistent id row: a slice, no
            # per-block Python, so host work stays per lane whatever the context.
            rest.append(t.ids[shared : f + 1])
            valid.append((f - shared) * block_size + used)
            slots.append(t.blocks[f] * block_size + p % block_size)
            continue
        runs, gaps = _bridge(t.span(shared, f + 1), bridge)
        last, last_gaps = runs.pop(), gaps.pop()  # ends with the current block
        segments, gathered = _split(runs, block_size, gaps, device)
        if last.count >= MIN_RUN:
            tokens = (last.count - 1) * block_size + used
            last_bias = _gap_bias(last_gaps, tokens, block_size, device)
            segments.append(Segment(last.block, tokens, last_bias))
            n_valid = len(gathered) * block_size
        else:
            gathered.extend(range(last.block, last.block + last.count - 1))
            n_valid = len(gathered) * block_size + used
            gathered.append(last.block + last.count - 1)
        lane_segments.extend((lane, s) for s in segments)
        valid.append(n_valid)
        rest.append(torch.tensor(gathered, dtype=torch.int32))
        slots.append(t.blocks[f] * block_size + p % block_size)
    width = max(r.shape[0] for r in rest)
    ids = bias = empty = None
    if width:
        # NOTE: padded with block 0; the bias hides it (and the last block's unused slots).
        table = torch.zeros(len(rest), width, dtype=torch.long)
        for i, r in enumerate(rest):
            table[i, : r.shape[0]] = r
        ids = table.to(device)
        lanes = torch.arange(width * block_size, device=device)
        hidden = lanes[None, :] >= torch.tensor(valid, device=device)[:, None]
        bias = torch.zeros(len(rest), 1, 1, width * block_size, device=device)
        bias.masked_fill_(hidden[:, None, None, :], float("-inf"))
        if min(valid) == 0:
            empty = torch.tensor([v == 0 for v in valid], device=device)
    span = DecodeSpan(start, len(tables), shared_segments, lane_segments, ids, bias, empty)
    return span, slots


def _plan_paged_decode(
    tables: list[SeqTable],
    positions: list[int],
    start: int,
    block_size: int,
    shared: int,
    shared_segments: list[Segment],
) -> tuple[DecodeSpan, list[int]]:
    """:func:`plan_decode` for a kernel that reads each lane's table: the tables as one
    int32 tensor (a view of a lone lane's persistent row; a row copy per lane
    otherwise), no per-block work at all."""
    used = [p // block_size + 1 for p in positions]
    if len(tables) == 1:
        ids = tables[0].ids[None, : used[0]]
    else:
        ids = torch.zeros(len(tables), max(used), dtype=torch.int32)
        for i, (t, n) in enumerate(zip(tables, used, strict=True)):
            ids[i, :n] = t.ids[:n]
    lengths = torch.tensor([p + 1 for p in positions], dtype=torch.long)
    slots = [
        t.blocks[p // block_size] * block_size + p % block_size
        for t, p in zip(tables, positions, strict=True)
    ]
    span = DecodeSpan(
        start,
        len(tables),
        shared_segments,
        [],
        None,
        None,
        None,
        tables=ids,
        lengths=lengths,
        key_start=shared * block_size,
    )
    return span, slots
