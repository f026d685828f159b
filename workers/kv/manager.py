"""Per-sequence block tables over the block pool, and automatic prefix caching.

Design: the scheduler asks this manager three things, all plain CPU bookkeeping:
- `admit(seq, num_new, reserve, max_cached)`: the sequence's cached prefix (every leading
  full block whose chained hash is in the pool, at most `len(tokens) - 1` tokens so the last
  token is always computed and gives logits, and at most `max_cached` tokens when the caller
  needs some rows computed, e.g. a prompt scored for its logprobs) plus fresh blocks for the
  next `num_new` tokens, or nothing if they do not fit;
- `grow(seq, end)`: blocks up to position `end` for a running sequence, or False (then the
  scheduler preempts);
- `free(seq)`: every reference dropped, last block first.
After each step, `cache_full_blocks` indexes the blocks that became full and computed, so the
next request with the same prefix finds them. A sequence only ever writes positions at or
past its `num_computed`, which lie in blocks it allocated itself: blocks it got from the
cache are full and never written again.

The state lives on the sequence (`block_ids`, `block_hashes`, `num_cached_blocks`), so a
preempted sequence keeps its hashes and finds its own blocks again if they were not evicted.
Trade-off: a prefix is reused only in whole blocks (a 16-token block size wastes up to 15
tokens of a shared prefix), which keeps matching to one dictionary lookup per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from workers.kv.blocks import BlockPool
from workers.kv.hashing import chain_hashes


class KVSequence(Protocol):
    """What the manager keeps on a sequence (the scheduler's `Sequence` has these slots)."""

    block_ids: list[int]
    block_hashes: list[bytes]
    num_cached_blocks: int  # leading blocks that are full, computed and indexed (or were hits)
    num_computed: int  # leading tokens whose K/V are in the cache

    def token_ids(self) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Admission:
    """A sequence taken in: how many leading tokens came from the prefix cache."""

    cached_tokens: int
    queried_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, root: bytes = b"") -> None:
        if block_size < 1:
            raise ValueError(f"`block_size` must be >= 1, got `{block_size}`")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.root = root  # the hash chain's start: model, dtype, quantization, block size

    # -- capacity -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def max_tokens(self) -> int:
        """Tokens the whole pool holds: no sequence can be longer."""
        return self.pool.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (cached free blocks count as free)."""
        return self.pool.num_used / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- sequences ------------------------------------------------------------------------------

    def admit(self, seq: KVSequence, num_new: int, reserve: int = 0, max_cached: int | None = None) -> Admission | None:
        """Give a waiting sequence its cached prefix (at most `max_cached` tokens of it) and blocks
        for up to `num_new` more tokens, keeping `reserve` blocks free; None (and nothing taken)
        when they do not fit."""
        tokens = seq.token_ids()
        hits = self._prefix_hits(seq, tokens, max_cached)
        cached = len(hits) * self.block_size
        num_new = min(num_new, len(tokens) - cached)
        fresh = self.blocks_for(cached + num_new) - len(hits)
        reclaimed = sum(1 for b in hits if self.pool.ref_count[b] == 0)  # hits now in the free queue
        if fresh + reclaimed + reserve > self.pool.num_free:
            return None
        self.pool.share(hits)
        seq.block_ids = hits + self.pool.allocate(fresh)
        seq.num_cached_blocks = len(hits)
        seq.num_computed = cached
        return Admission(cached, len(tokens) if self.prefix_caching and max_cached != 0 else 0)

    def grow(self, seq: KVSequence, end: int) -> bool:
        """Blocks for positions `< end`; False when the pool has too few free blocks."""
        need = self.blocks_for(end) - len(seq.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, seq: KVSequence) -> None:
        """Drop the sequence's blocks, last first: its cached prefix outlives its tail."""
        self.pool.release(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_cached_blocks = 0

    def cache_full_blocks(self, seq: KVSequence) -> None:
        """Index the sequence's blocks that are now full and computed (after a step)."""
        full = seq.num_computed // self.block_size
        if not self.prefix_caching or full <= seq.num_cached_blocks:
            return
        chain_hashes(self._root(seq), seq.token_ids()[: full * self.block_size], self.block_size, seq.block_hashes)
        for i in range(seq.num_cached_blocks, full):
            self.pool.register(seq.block_ids[i], seq.block_hashes[i])
        seq.num_cached_blocks = full

    def _root(self, seq: KVSequence) -> bytes:
        """The sequence's own hash root where its blocks' contents depend on more than the model and
        its tokens (a prompt whose length changes its rotation: workers/model/rope.py)."""
        return getattr(seq, "cache_root", None) or self.root

    def _prefix_hits(self, seq: KVSequence, tokens: list[int], max_cached: int | None) -> list[int]:
        """Cached blocks holding the sequence's leading full blocks, before its last token (and
        within its first `max_cached` tokens)."""
        limit = (len(tokens) - 1 if max_cached is None else min(len(tokens) - 1, max_cached)) // self.block_size
        if not self.prefix_caching or limit == 0:
            return []
        chain_hashes(self._root(seq), tokens[: limit * self.block_size], self.block_size, seq.block_hashes)
        hits = []
        for h in seq.block_hashes[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits
