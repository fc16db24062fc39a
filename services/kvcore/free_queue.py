"""The LRU free queue: an intrusive doubly-linked list of KVBlocks with sentinels."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .block import KVBlock


class FreeBlockQueue:
    """Free blocks in eviction order: the head is evicted first.

    NOTE: a deque would make "remove this block because a request just hit it" O(n).
    Linking through the blocks themselves makes popleft, remove and append all
    O(1), and sentinels remove every head/tail special case.
    """

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(block_id=-1)  # sentinel before the first free block
        self._tail = KVBlock(block_id=-1)  # sentinel after the last free block
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0  # number of real blocks linked in
        self.extend(blocks)

    def __len__(self) -> int:
        return self.num_free

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        assert first is not None
        if first is self._tail:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVBlock]:
        if n > self.num_free:
            raise IndexError(f"asked for {n} free blocks, have {self.num_free}")
        return [self.popleft() for _ in range(n)]

    def peekleft(self) -> KVBlock | None:
        first = self._head.next_free
        return None if first is self._tail else first

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        """Link at the tail: evicted last."""
        self._link_before(self._tail, block)

    def appendleft(self, block: KVBlock) -> None:
        """Link at the head: evicted (or reused) first."""
        first = self._head.next_free
        assert first is not None
        self._link_before(first, block)

    def extend(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            self.append(block)

    def _link_before(self, anchor: KVBlock, block: KVBlock) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        prev = anchor.prev_free
        assert prev is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = anchor
        anchor.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free
