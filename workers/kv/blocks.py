"""The block allocator: reference counts, the free queue and the prefix cache's index.

Design (vLLM v1 `BlockPool`): blocks are ids into the KV tensors, counted by the sequences that
share them. A block whose count drops to 0 keeps its contents and hash in one ordered free
queue, front evicted first: blocks that hold nothing anyone can ask for (never used, partial,
caching off) go to the front, hashed ones to the back, so cached blocks are evicted in LRU order
(a sequence frees its last block first, so a prefix's head outlives its tail). Allocation pops
the front and drops its hash. Every operation is O(1) per block. Trade-off: a hash maps to one
block; when two sequences compute the same block at once, the second copy stays unindexed and is
reused as a plain free block."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Reference-counted blocks, an LRU free queue and `hash -> block` for full cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"A block pool needs `num_blocks` >= 1, got `{num_blocks}`")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding those contents
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: evicted first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that an allocation can take now (never used, freed, or cached and unused)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, n: int) -> list[int]:
        """`n` blocks with reference count 1, evicting cached ones from the front of the queue."""
        if n > len(self.free):
            raise MemoryError(f"Asked for `{n}` KV blocks, `{len(self.free)}` free of {self.num_blocks}")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:  # evict: its contents are about to be overwritten
                self.block_hash[block] = None
                del self.cached[h]
                self.evictions += 1
            self.ref_count[block] = 1
            out.append(block)
        return out

    def lookup(self, h: bytes) -> int | None:
        """The cached block holding the contents hashed `h`, if any (in use or free)."""
        return self.cached.get(h)

    def share(self, blocks: Iterable[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit); free ones leave the queue."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference per block, in the order given (last block first, see above)."""
        for block in blocks:
            count = self.ref_count[block] - 1
            if count < 0:
                raise AssertionError(f"KV block `{block}` released more often than it was taken")
            self.ref_count[block] = count
            if count == 0:
                self.free[block] = None  # the back: cached contents stay, evicted last
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)  # nothing to keep: reuse first

    def register(self, block: int, h: bytes) -> bool:
        """Index a full, computed block under its hash; False when another block already holds it."""
        if h in self.cached or self.block_hash[block] is not None:
            return False
        self.cached[h] = block
        self.block_hash[block] = h
        return True
