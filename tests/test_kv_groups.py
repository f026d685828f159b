"""KV groups (workers/kv/groups.py): a full group and a sliding group over separate block pools,
driven like the scheduler drives them, without a model.

The random harness keeps a shadow of every slot of every group, written the way the model
writes K/V, and checks after each operation that every position the next query can see
holds the right token in every group (the full group: all of them; the sliding group: the
last `W`), that a sliding group holds no more than a window of blocks per sequence, and that
reference counts, the free queue and cached contents stay consistent.
"""

from __future__ import annotations

import random

from tests.test_kv_cache import FakeSeq
from workers.kv.groups import first_needed, layer_groups, plan_groups, window_blocks
from workers.kv.hashing import chain_hashes, root_hash
from workers.kv.manager import KVCacheManager

BS, W = 4, 6


class Harness:
    def __init__(self, groups: tuple[tuple[int | None, int], ...], seed: int):
        self.kv = KVCacheManager(groups[0][1], BS, prefix_caching=True, root=root_hash("groups"), groups=groups)
        self.rng = random.Random(seed)
        self.live: list[FakeSeq] = []
        self.slots = [dict() for _ in groups]  # per group: slot -> token whose K/V it holds
        self.snapshot = [dict() for _ in groups]  # per group: cached block -> contents when indexed
        self.prefixes = [[self.rng.randrange(50) for _ in range(self.rng.randrange(4, 24))] for _ in range(4)]

    def table(self, seq: FakeSeq, g: int) -> list[int]:
        return seq.block_ids if g == 0 else seq.group_tables[g - 1]

    def contents(self, g: int, block: int) -> tuple:
        return tuple(self.slots[g].get(block * BS + i) for i in range(BS))

    def compute(self, seq: FakeSeq, n: int) -> None:
        for g, pool in enumerate(self.kv.pools):
            table = self.table(seq, g)
            for pos in range(seq.num_computed, seq.num_computed + n):
                block = table[pos // BS]
                assert pool.ref_count[block] == 1 and pool.block_hash[block] is None, f"group {g}: shared write"
                self.slots[g][block * BS + pos % BS] = seq.tokens[pos]
                self.snapshot[g].pop(block, None)
        seq.num_computed += n
        self.kv.cache_full_blocks(seq)
        for g in range(len(self.kv.pools)):
            table = self.table(seq, g)
            for i in range(seq.held_from[g], seq.num_cached_blocks):
                self.snapshot[g].setdefault(table[i], self.contents(g, table[i]))
        self.kv.slide(seq)
        for g, window in enumerate(self.kv.windows):  # bounded: about one window of blocks each
            if window is not None:
                assert len(self.table(seq, g)) - seq.held_from[g] <= window_blocks(window, BS)

    def visible_ok(self, seq: FakeSeq) -> None:
        """What the next query (at `num_computed`) reads from the cache holds the sequence's tokens."""
        q = seq.num_computed
        for g, window in enumerate(self.kv.windows):
            table = self.table(seq, g)
            start = 0 if window is None else max(0, q - window + 1)
            for pos in range(start, q):
                assert pos // BS >= seq.held_from[g], f"group {g}: position {pos} is in a freed block"
                assert self.slots[g][table[pos // BS] * BS + pos % BS] == seq.tokens[pos], (g, pos)

    def op_admit(self) -> None:
        tokens = list(self.rng.choice(self.prefixes)) + [self.rng.randrange(50)
                                                         for _ in range(self.rng.randrange(1, 12))]
        seq = FakeSeq(tokens)
        want = self.rng.randrange(1, 16)
        if self.kv.admit(seq, want) is None:
            assert not seq.block_ids
            return
        self.visible_ok(seq)  # the cached prefix serves every group
        self.live.append(seq)
        self.compute(seq, min(len(tokens) - seq.num_computed, want))
        self.visible_ok(seq)

    def op_grow(self) -> None:
        seq = self.rng.choice(self.live)
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(self.rng.randrange(50))
        n = min(len(seq.tokens) - seq.num_computed, self.rng.randrange(1, 8))
        if self.kv.grow(seq, seq.num_computed + n):
            self.compute(seq, n)
            self.visible_ok(seq)

    def op_free(self) -> None:
        seq = self.live.pop(self.rng.randrange(len(self.live)))
        self.kv.free(seq)
        assert not seq.block_ids and not seq.group_tables

    def check(self) -> None:
        for g, pool in enumerate(self.kv.pools):
            held = [0] * pool.num_blocks
            for seq in self.live:
                for block in self.table(seq, g)[seq.held_from[g] :]:
                    held[block] += 1
            assert pool.ref_count == held, f"group {g}"
            assert set(pool.free) == {b for b in range(pool.num_blocks) if held[b] == 0}
            for h, block in pool.cached.items():
                assert pool.block_hash[block] == h
                assert self.contents(g, block) == self.snapshot[g][block]  # cached contents never change


def _run(groups, seed: int, ops: int = 6000) -> Harness:
    h = Harness(groups, seed)
    for _ in range(ops):
        op = h.rng.choices(["admit", "grow", "free"], weights=[3, 8, 2])[0]
        getattr(h, f"op_{op if h.live else 'admit'}")()
        h.check()
    while h.live:
        h.op_free()
        h.check()
    return h


def test_full_and_sliding_groups_under_random_operations():
    """Admissions with prefix hits, growth by chunks and decodes, frees, over a full group of 40
    blocks and a sliding group of 24: every visible position is right in both groups, the
    sliding group frees its past (guards `KVCacheManager.slide`: without it the bound fails)."""
    h = _run(((None, 40), (W, 24)), seed=1)
    assert h.kv.usage == 0 and all(p.num_free == p.num_blocks for p in h.kv.pools)
    assert h.kv.pools[1].evictions > 20 and h.kv.pools[0].evictions > 20  # both caches exercised


def test_only_sliding_layers_hold_a_window_each():
    """A model whose every layer slides (one group, windowed): the same invariants."""
    h = _run(((W, 16),), seed=2)
    assert h.kv.usage == 0 and h.kv.pools[0].evictions > 20


def test_a_prefix_hit_needs_the_windows_blocks_in_the_sliding_group():
    """Group 0 holds 6 cached blocks of the prompt, the sliding group (W=8) only its first 4:
    the hit is the longest prefix whose next query finds its window (16 tokens: blocks 2, 3),
    and the sliding table starts with placeholders before them."""
    kv = KVCacheManager(32, BS, root=root_hash("hit"), groups=((None, 32), (8, 32)))
    tokens = list(range(100, 130))
    hashes = chain_hashes(kv.root, tokens[:24], BS, [])
    for g, count in ((0, 6), (1, 4)):
        blocks = kv.pools[g].allocate(count)
        for b, h in zip(blocks, hashes, strict=False):
            kv.pools[g].register(b, h)
        kv.pools[g].release(blocks)
    seq = FakeSeq(tokens)
    admission = kv.admit(seq, 8)
    assert admission.cached_tokens == 16 and seq.num_computed == 16
    assert seq.block_ids[:4] == [kv.pools[0].lookup(h) for h in hashes[:4]]
    assert seq.held_from == [0, first_needed(8, 16, BS)] == [0, 2]
    assert seq.group_tables[0][2:4] == [kv.pools[1].lookup(h) for h in hashes[2:4]]
    assert len(seq.group_tables[0]) == len(seq.block_ids) == 6  # 16 cached + 8 new tokens


def test_groups_split_the_budget_a_window_per_sequence_and_the_rest_to_full_layers():
    windows = (8, 8, None, 8, 8, None)
    assert layer_groups(windows) == ((None, (2, 5)), (8, (0, 1, 3, 4)))
    page = 1000  # bytes of one block of one layer
    full, sliding = plan_groups(windows, page, budget=600_000, block_size=4, max_sequences=4, max_batched_tokens=32)
    assert sliding.num_blocks == 4 * (window_blocks(8, 4) + 1) + 8 == 24
    assert full.layers == (2, 5) and full.num_blocks == (600_000 - 24 * 4 * page) // (2 * page) == 252
    assert full.num_blocks * 2 * page + sliding.num_blocks * 4 * page <= 600_000
    # a small budget: the groups get the same blocks (the sliding one needs no fewer)
    small = plan_groups(windows, page, budget=60_000, block_size=4, max_sequences=4, max_batched_tokens=32)
    assert [g.num_blocks for g in small] == [10, 10]
    (only,) = plan_groups((8, 8), page, budget=50_000, block_size=4, max_sequences=4, max_batched_tokens=32)
    assert only.window == 8 and only.num_blocks == 25
