"""The block manager's two hooks into the host tier (workers/kv/manager.py), without a model: a
fake tier holding blocks by hash stands for workers/kvtier/tier.py `HostTier`."""

from __future__ import annotations

from tests.test_kv_cache import BS, FakeSeq
from workers.kv.hashing import root_hash
from workers.kv.manager import KVCacheManager
from workers.kvtier.format import partial_key


class FakeTier:
    def __init__(self) -> None:
        self.held: dict[bytes, str] = {}  # hash -> payload
        self.loaded: list[tuple[int, str]] = []
        self.partials: dict[bytes, tuple[str, list[int]]] = {}  # partial key -> (payload, tokens)

    def cached(self, block: int, h: bytes) -> None:
        self.held.setdefault(h, f"block {block}")

    def fetch(self, hashes, parent=None):
        out = []
        for h in hashes:
            if h not in self.held:
                break
            out.append(self.held[h])
        if parent is not None:
            key = partial_key(hashes[len(out) - 1] if out else parent)
            if key in self.partials:
                block, tokens = self.partials[key]
                return [*out, block], tokens
        return out, []

    def partial(self, block, parent, tokens) -> None:
        self.partials[partial_key(parent)] = (f"partial {block}", list(tokens))

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
    assert admission.cached_tokens == 13, "three blocks from the tier (the device held none), and the partial one"
    assert again.num_computed == 13 and again.num_cached_blocks == 3
    assert [b for b, _ in tier.loaded] == again.block_ids[:4], "copied into the sequence's first blocks"
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


def test_a_preempted_sequence_is_swapped_out_whole_and_resumes_past_every_computed_token():
    """Guards `free`'s `_write_partial` and `_host_hits`' partial block: without them a resumed
    sequence recomputes the tokens of its last, partly filled block."""
    tier = FakeTier()
    kv = manager(4, tier)
    seq = FakeSeq(list(range(11)))  # two full blocks and three tokens computed, the 11th not yet
    assert kv.admit(seq, 11) is not None
    seq.num_computed = 10
    kv.cache_full_blocks(seq)
    assert len(tier.held) == 2
    assert kv.swap_out(seq)
    kv.free(seq)
    assert [t for _, t in tier.partials.values()] == [[8, 9]], "the partly filled block, with its tokens"
    run(kv, FakeSeq([99] * 16))  # every block of the sequence evicted from the device
    resumed = FakeSeq(seq.tokens)
    assert kv.admit(resumed, 11).cached_tokens == 10, "everything but the token it has not computed"
    assert resumed.num_computed == 10 and resumed.num_cached_blocks == 2, "the partial block is not indexed"
    assert [b for b, _ in tier.loaded] == resumed.block_ids[:3]
    assert tier.loaded[-1][1].startswith("partial")


def test_a_finished_turns_partial_block_serves_the_next_turn_as_far_as_its_tokens_agree():
    """The next turn of a conversation resends the last turn's tokens and more: the partial block
    gives the tokens they share (8, 9), not the one it held that the new prompt does not (10)."""
    tier = FakeTier()
    kv = manager(4, tier)
    first = FakeSeq(list(range(12)))
    assert kv.admit(first, 12) is not None
    first.num_computed = 11
    kv.cache_full_blocks(first)
    kv.free(first)  # finished: holds 8, 9, 10 in its partial block
    run(kv, FakeSeq([99] * 16))
    other = FakeSeq(list(range(10)) + [77, 78, 79])  # shares 8, 9 of the partial block
    assert kv.admit(other, 13).cached_tokens == 10
    assert other.num_cached_blocks == 2


def test_a_partial_block_of_other_tokens_is_not_taken():
    tier = FakeTier()
    kv = manager(4, tier)
    seq = FakeSeq(list(range(11)))
    assert kv.admit(seq, 11) is not None
    seq.num_computed = 10
    kv.cache_full_blocks(seq)
    kv.free(seq)
    other = FakeSeq(list(range(8)) + [77, 78, 79])  # the same two full blocks, another tail
    assert kv.admit(other, 11).cached_tokens == 8
    assert not any(p.startswith("partial") for _, p in tier.loaded)
