"""From hash ids to token content and kvcore block hashes, keeping the trace's sharing exact.

A trace names each prompt block by an id; kvcore hashes token content. The
mapping here gives every id its own deterministic token content, so kvcore's
chained hashes are equal exactly when the trace's id prefixes are equal (and the
tenant is the same), at any kvcore block size that divides the trace's.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from cachepoint.kvcore import ROOT_HASH, BlockHash, ExtraKeys, hash_blocks
from cachepoint.sim.trace import Trace, TraceRequest

VOCAB = 128_256  # token ids stay inside a Llama-3-sized vocabulary
ID_TOKENS = 3  # leading tokens that spell the id in base VOCAB: ids up to VOCAB**3 (2e15)
SIM_MODEL = "cachepoint-sim"  # the model id in every block's extra keys


def _filler(n: int) -> array[int]:
    return array("i", ((i * 7919 + 104_729) % VOCAB for i in range(n)))


class BlockContent:
    """Token content of trace blocks: the id spelled in the first tokens, then fixed filler.

    NOTE: spelling the id in base VOCAB makes the mapping injective, which is what
    "nothing else collides" needs; the filler is shared because only the chained
    hash ever reads it, and copying one array is far cheaper than generating
    half a million pseudo-random tokens per thousand blocks.
    """

    __slots__ = ("_fill", "block_tokens", "max_id")

    def __init__(self, block_tokens: int) -> None:
        if block_tokens <= 0:
            raise ValueError("block_tokens must be positive")
        self.block_tokens = block_tokens  # tokens per trace block
        self.max_id = VOCAB ** min(ID_TOKENS, block_tokens) - 1  # largest id we can spell
        self._fill = _filler(block_tokens)  # tokens after the id

    def tokens(self, hash_id: int, length: int | None = None) -> array[int]:
        """The block's tokens, or its first ``length`` (a partial last block)."""
        if not 0 <= hash_id <= self.max_id:
            raise ValueError(f"hash id {hash_id} outside 0..{self.max_id}")
        n = self.block_tokens if length is None else length
        digits = min(ID_TOKENS, self.block_tokens)
        head = array("i", ((hash_id // VOCAB**d) % VOCAB for d in range(digits)))
        out = head + self._fill[digits:]
        return out[:n] if n < self.block_tokens else out

    def prompt(self, req: TraceRequest) -> array[int]:
        """The whole prompt of a request, exactly ``input_length`` tokens."""
        out = array("i")
        left = req.input_length
        for hid in req.hash_ids:
            take = min(left, self.block_tokens)
            out.extend(self.tokens(hid, take))
            left -= take
        return out


def extra_keys_for(tenant: str | None) -> ExtraKeys:
    """kvcore extra keys of a request: the model id, plus the org key when there is a tenant."""
    return (SIM_MODEL,) if tenant is None else (SIM_MODEL, f"org:{tenant}")


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A trace request with what the simulator needs precomputed."""

    nodes: tuple[int, ...]  # prefix identity of each trace block (equal node = equal prefix)
    block_hashes: tuple[BlockHash, ...]  # kvcore chained hashes of the full kvcore blocks
    keys: ExtraKeys  # the extra keys those hashes were computed with


class TraceHasher:
    """Interns prefix chains and computes kvcore hashes once per distinct block.

    A node is one (tenant, id prefix); the trace's sharing is the sharing of nodes.
    Each full node's kvcore hashes are computed once with kvcore's own
    `hash_blocks`, chained from its parent's last hash, and reused: the result is
    bit-identical to hashing the whole prompt (a test checks that), at a fraction
    of the cost on traces where most blocks repeat.
    """

    __slots__ = ("_content", "_memo", "_nodes", "block_size", "block_tokens")

    def __init__(self, block_tokens: int, block_size: int) -> None:
        if block_size <= 0 or block_tokens % block_size:
            raise ValueError(
                f"the kvcore block size ({block_size}) must divide the trace's "
                f"block size ({block_tokens})"
            )
        self.block_tokens = block_tokens  # tokens per trace block
        self.block_size = block_size  # tokens per kvcore block
        self._content = BlockContent(block_tokens)  # id -> token content
        self._nodes: dict[
            tuple[int, int | str | None, int], int
        ] = {}  # (parent, tenant, id) -> node
        self._memo: dict[int, tuple[BlockHash, ...]] = {}  # full node -> its kvcore hashes

    @property
    def num_nodes(self) -> int:
        """Distinct prefix blocks seen so far."""
        return len(self._nodes)

    def nodes(self, req: TraceRequest) -> tuple[int, ...]:
        """The prefix node of each of the request's trace blocks."""
        table = self._nodes
        out: list[int] = []
        parent = -1
        tenant = req.tenant
        for hid in req.hash_ids:
            key = (parent, tenant, hid)
            node = table.get(key)
            if node is None:
                node = table[key] = len(table)
            out.append(node)
            parent = node
        return tuple(out)

    def prepare(self, req: TraceRequest) -> PreparedRequest:
        keys = extra_keys_for(req.tenant)
        nodes = self.nodes(req)
        full = req.input_length // self.block_tokens
        hashes: list[BlockHash] = []
        parent = ROOT_HASH
        memo = self._memo
        for pos in range(full):
            node = nodes[pos]
            got = memo.get(node)
            if got is None:
                toks = self._content.tokens(req.hash_ids[pos])
                got = memo[node] = tuple(hash_blocks(toks, self.block_size, keys, parent))
            hashes.extend(got)
            parent = got[-1]
        rem = req.input_length - full * self.block_tokens
        if rem >= self.block_size:
            toks = self._content.tokens(req.hash_ids[full], rem)
            hashes.extend(hash_blocks(toks, self.block_size, keys, parent))
        return PreparedRequest(nodes, tuple(hashes), keys)

    def prepare_all(self, trace: Trace) -> list[PreparedRequest]:
        return [self.prepare(r) for r in trace.requests]
