"""The block allocator and the prefix cache's bookkeeping, without a model: invariants under
10,000 random operations, LRU eviction order, and chained block hashes."""

from __future__ import annotations

import random

import pytest

from workers.kv.blocks import BlockPool
from workers.kv.hashing import block_hash, chain_hashes, root_hash
from workers.kv.manager import KVCacheManager

BS = 4


class FakeSeq:
    """What the manager keeps on a sequence, plus the tokens it will compute."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens
        self.block_ids: list[int] = []
        self.group_tables: list[list[int]] = []  # the other KV groups' tables (tests/test_kv_groups.py)
        self.held_from: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.num_computed = 0

    def token_ids(self) -> list[int]:
        return self.tokens


class Harness:
    """Drives a `KVCacheManager` like the scheduler does and keeps a shadow of what each cache
    slot holds, written the way the model writes K/V (positions from `num_computed` on)."""

    def __init__(self, num_blocks: int, seed: int):
        self.kv = KVCacheManager(num_blocks, BS, prefix_caching=True, root=root_hash("test"))
        self.rng = random.Random(seed)
        self.live: list[FakeSeq] = []
        self.slots: dict[int, int] = {}  # slot -> token whose K/V it holds
        self.snapshot: dict[int, tuple] = {}  # cached block -> its contents when it was indexed
        self.prefixes = [[self.rng.randrange(50) for _ in range(self.rng.randrange(1, 20))] for _ in range(4)]

    def compute(self, seq: FakeSeq, n: int) -> None:
        """Write tokens `num_computed .. +n` through the block table, then index full blocks."""
        for pos in range(seq.num_computed, seq.num_computed + n):
            block = seq.block_ids[pos // BS]
            assert self.kv.pool.ref_count[block] == 1, f"write into shared block {block}"
            assert self.kv.pool.block_hash[block] is None, f"write into cached block {block}"
            self.slots[block * BS + pos % BS] = seq.tokens[pos]
            self.snapshot.pop(block, None)  # a fresh (or evicted and reused) block
        seq.num_computed += n
        self.kv.cache_full_blocks(seq)
        for block in seq.block_ids[: seq.num_cached_blocks]:
            self.snapshot.setdefault(block, self.contents(block))

    def contents(self, block: int) -> tuple:
        return tuple(self.slots.get(block * BS + i) for i in range(BS))

    def op_admit(self) -> None:
        tokens = list(self.rng.choice(self.prefixes)) + [self.rng.randrange(50)
                                                         for _ in range(self.rng.randrange(1, 12))]
        seq = FakeSeq(tokens)
        want = self.rng.randrange(1, 16)
        admission = self.kv.admit(seq, want)
        if admission is None:
            assert not seq.block_ids
            return
        # reuse correctness: every hit block holds exactly this sequence's tokens
        for i in range(seq.num_cached_blocks):
            assert self.contents(seq.block_ids[i]) == tuple(tokens[i * BS : (i + 1) * BS])
        self.live.append(seq)
        self.compute(seq, min(len(tokens) - seq.num_computed, want))

    def op_grow(self) -> None:
        seq = self.rng.choice(self.live)
        if seq.num_computed == len(seq.tokens):  # a decode: the last sampled token joins
            seq.tokens.append(self.rng.randrange(50))
        n = min(len(seq.tokens) - seq.num_computed, self.rng.randrange(1, 8))
        if self.kv.grow(seq, seq.num_computed + n):
            self.compute(seq, n)

    def op_free(self) -> None:
        seq = self.live.pop(self.rng.randrange(len(self.live)))
        self.kv.free(seq)
        assert not seq.block_ids

    def check(self) -> None:
        pool = self.kv.pool
        held = [0] * pool.num_blocks
        for seq in self.live:
            for block in seq.block_ids:
                held[block] += 1
        assert pool.ref_count == held  # no leak, no double free, never negative
        assert set(pool.free) == {b for b in range(pool.num_blocks) if held[b] == 0}
        for h, block in pool.cached.items():
            assert pool.block_hash[block] == h
            assert self.contents(block) == self.snapshot[block]  # cached contents never change


def test_allocator_invariants_under_random_operations():
    """10,000 random admissions (prefix hits: share; new blocks: allocate, evicting cached
    ones), growths and frees over a pool small enough to be always under pressure."""
    h = Harness(num_blocks=24, seed=0)
    counts = {"admit": 0, "grow": 0, "free": 0}
    for _ in range(10_000):
        op = h.rng.choices(["admit", "grow", "free"], weights=[3, 6, 2])[0]
        if op != "admit" and not h.live:
            op = "admit"
        getattr(h, f"op_{op}")()
        counts[op] += 1
        h.check()
    while h.live:
        h.op_free()
        h.check()
    assert h.kv.num_free_blocks == 24 and h.kv.usage == 0
    assert h.kv.pool.evictions > 50 and len(h.kv.pool.cached) > 0  # the cache was really exercised
    assert min(counts.values()) > 1000


def test_free_queue_order_uncached_first_then_lru():
    pool = BlockPool(6)
    a, b = pool.allocate(3), pool.allocate(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    pool.register(a[0], b"h0")
    pool.register(a[1], b"h1")
    pool.release(reversed(a))  # 2 (no hash) goes to the front, then 1, 0 to the back
    assert list(pool.free) == [2, 5, 1, 0]
    pool.share([pool.lookup(b"h1")])  # a hit takes block 1 back out of the queue
    assert list(pool.free) == [2, 5, 0] and pool.ref_count[1] == 1
    assert pool.allocate(3) == [2, 5, 0] and pool.evictions == 1 and pool.lookup(b"h0") is None
    with pytest.raises(MemoryError, match="Asked for `1` KV blocks, `0` free of 6"):
        pool.allocate(1)
    pool.release([1])
    with pytest.raises(AssertionError, match="released more often"):
        pool.release([1])


def test_a_hash_maps_to_one_block():
    pool = BlockPool(3)
    x, y = pool.allocate(2)
    assert pool.register(x, b"same") and not pool.register(y, b"same") and not pool.register(x, b"other")
    assert pool.lookup(b"same") == x and pool.block_hash[y] is None


def test_block_hashes_chain_over_the_prefix_and_the_root():
    root = root_hash("model", "float32", 4)
    hashes = chain_hashes(root, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4, [])
    assert len(hashes) == 2 and hashes[1] == block_hash(hashes[0], [5, 6, 7, 8])
    # the same block after a different prefix, or under another model, is another block
    assert chain_hashes(root, [0, 2, 3, 4, 5, 6, 7, 8], 4, [])[1] != hashes[1]
    assert chain_hashes(root_hash("model", "bfloat16", 4), [1, 2, 3, 4], 4, [])[0] != hashes[0]
    known = hashes[:1]
    assert chain_hashes(root, [1, 2, 3, 4, 5, 6, 7, 8], 4, known) == hashes and known is not hashes
