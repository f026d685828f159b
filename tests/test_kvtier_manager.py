"""The block manager's two hooks into the host tier (workers/kv/manager.py), without a model: a
fake tier holding blocks by hash stands for workers/kvtier/tier.py `HostTier`."""

from __future__ import annotations

from tests.test_kv_cache import BS, FakeSeq
from workers.kv.hashing import root_hash
from workers.kv.manager import KVCacheManager


class FakeTier:
    def __init__(self) -> None:
        self.held: dict[bytes, str] = {}  # hash -> payload
        self.loaded: list[tuple[int, str]] = []

    def cached(self, block: int, h: bytes) -> None:
        self.held.setdefault(h, f"block {block}")

    def fetch(self, hashes):
        out = []
        for h in hashes:
            if h not in self.held:
                break
            out.append(self.held[h])
        return out

    def load(self, blocks, payloads) -> None:
        self.loaded += list(zip(blocks, payloads, strict=True))


def manager(num_blocks: int, tier: FakeTier) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, BS, prefix_caching=True, root=root_hash("test"))
    kv.tier = tier
    return kv


def run(kv: KVCacheManager, seq: FakeSeq) -> None:
    """Admit and compute the whole sequence, then free it (its blocks stay cached)."""
    assert kv.admit(seq, len(seq.tokens)) is not None
    seq.num_computed = len(seq.tokens)
    kv.cache_full_blocks(seq)
    kv.free(seq)


def test_full_blocks_are_written_through_once_and_read_back_past_the_devices_hits():
    tier = FakeTier()
    kv = manager(4, tier)
    tokens = list(range(13))  # 3 full blocks and one token
    run(kv, FakeSeq(tokens))
    assert len(tier.held) == 3, "each full block, once"
    run(kv, FakeSeq([99] * 16))  # fills the pool: every cached block of the first is evicted
    again = FakeSeq(tokens + [7, 8])
    admission = kv.admit(again, 15)
    assert admission.cached_tokens == 12, "three blocks from the tier (the device held none)"
    assert again.num_computed == 12 and again.num_cached_blocks == 3
    assert [b for b, _ in tier.loaded] == again.block_ids[:3], "copied into the sequence's first blocks"
    assert all(kv.pool.lookup(h) == b for h, b in zip(again.block_hashes[:3], again.block_ids, strict=False)), \
        "and indexed like computed blocks"


def test_no_host_lookup_without_the_hook_and_none_past_the_last_token():
    """Guards `_host_hits`'s limit: the block holding the prompt's last token is computed (it
    gives the logits), even when the tier holds it."""
    tier = FakeTier()
    kv = manager(8, tier)
    tokens = list(range(8))  # exactly two blocks
    run(kv, FakeSeq(tokens))
    run(kv, FakeSeq([99] * 32))  # evicts them
    again = FakeSeq(tokens)
    assert kv.admit(again, 8).cached_tokens == 4, "the second block holds the last token: computed"
    kv.free(again)
    kv.tier = None
    run(kv, FakeSeq([98] * 32))
    assert kv.admit(FakeSeq(tokens), 8).cached_tokens == 0


def test_a_sequence_that_does_not_fit_loads_nothing():
    tier = FakeTier()
    kv = manager(4, tier)
    tokens = list(range(9))
    run(kv, FakeSeq(tokens))
    hog = FakeSeq([99] * 12)
    assert kv.admit(hog, 12) is not None  # holds 3 of 4 blocks
    assert kv.admit(FakeSeq(tokens + [1, 2, 3]), 12) is None
    assert tier.loaded == []
