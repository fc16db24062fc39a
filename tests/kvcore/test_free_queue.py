from __future__ import annotations

import pytest

from cachepoint.kvcore import FreeBlockQueue, KVBlock


def _ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_free_queue_popleft_is_fifo():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 4
    assert q.popleft().block_id == 0
    assert q.popleft_n(2) == blocks[1:3]
    assert _ids(q) == [3]


def test_free_queue_remove_from_middle_and_ends():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert _ids(q) == [1, 3]
    assert blocks[2] not in q
    assert blocks[2].prev_free is None
    assert blocks[2].next_free is None


def test_free_queue_append_and_appendleft():
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue()
    q.append(blocks[1])
    q.appendleft(blocks[0])
    q.append(blocks[2])
    assert _ids(q) == [0, 1, 2]
    assert q.peekleft() is blocks[0]


def test_free_queue_rejects_double_insert_and_foreign_remove():
    b = KVBlock(0)
    q = FreeBlockQueue([b])
    with pytest.raises(ValueError, match="already"):
        q.append(b)
    q.popleft()
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(b)
    with pytest.raises(IndexError):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft_n(1)
    assert q.peekleft() is None
