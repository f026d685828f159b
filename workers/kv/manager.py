"""Per-sequence block tables over the block pool, and automatic prefix caching.

Design: plain CPU bookkeeping behind three calls the scheduler makes: `admit` (the cached prefix,
whole blocks found by chained hash, plus fresh blocks for the next tokens, or nothing if they do
not fit), `grow` (blocks up to a position, or False: the scheduler preempts) and `free` (every
reference dropped, last block first). After each step `cache_full_blocks` indexes the blocks that
became full. A sequence writes only positions past its `num_computed`, in blocks it allocated, so
a cached block is never written again. The state lives on the sequence (`block_ids`,
`group_tables`, `held_from`, `block_hashes`), so a preempted sequence finds its own blocks again
if they were not evicted; every call covers every KV group, and the linear layers' state slot
(`seq.state_slot`) is taken and freed with the blocks. A hybrid's prefix ends where a snapshot
of that state does (`_at_snapshot`, workers/kv/snapshots.py). Trade-off: a prefix is reused only in
whole blocks (up to `block_size - 1` tokens of a shared prefix recomputed), which keeps matching
to one dictionary lookup per block."""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass
from typing import Protocol

from workers.kv.blocks import BlockPool
from workers.kv.groups import first_needed
from workers.kv.hashing import chain_hashes
from workers.kv.snapshots import LAST_BOUNDARY_BLOCKS, Snapshots
from workers.kv.state import StateSlots


class HostTierHooks(Protocol):
    """The host tier's side of a prefix lookup (workers/kvtier/tier.py `HostTier`)."""

    def cached(self, block: int, chain_hash: bytes) -> None: ...
    def fetch(self, hashes: list[bytes], parent: bytes | None = None) -> tuple[Sized, list[int]]: ...
    def load(self, blocks: list[int], payloads: Sized) -> None: ...
    def partial(self, block: int, parent: bytes, tokens: list[int]) -> None: ...
    def fetch_foreign(self, tokens: list[int], limit: int, chain) -> tuple[Sized, list[int]]: ...


class KVSequence(Protocol):
    """What the manager keeps on a sequence (the scheduler's `Sequence` has these slots)."""

    block_ids: list[int]
    group_tables: list[list[int]]  # the other groups' block tables (empty with one group)
    held_from: list[int]  # per group, its first held entry (0 unless the group slides)
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
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, root: bytes = b"",
                 groups: tuple[tuple[int | None, int], ...] | None = None, state_slots: int = 0,
                 state_snapshots: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"`block_size` must be >= 1, got `{block_size}`")
        groups = groups or ((None, num_blocks),)
        self.windows = tuple(w for w, _ in groups)
        self.pools = tuple(BlockPool(n) for _, n in groups)
        self.pool = self.pools[0]
        self.sliding = any(w is not None for w in self.windows)  # some group frees blocks as it slides
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.root = root  # the hash chain's start: model, dtype, quantization, block size
        self.states = StateSlots(state_slots) if state_slots else None  # linear layers' state slots
        self.tier: HostTierHooks | None = None  # host tier past the device cache (one full group only)
        self.snapshots: Snapshots | None = None  # the linear layers' state at block boundaries (hybrids)
        if self.states is not None and prefix_caching:
            if not state_snapshots or len(groups) != 1 or groups[0][0] is not None:
                raise ValueError("A prefix cache serves linear layers' state only through snapshots in one "
                                 "full-attention group (workers/kv/snapshots.py): `prefix_caching` must be False "
                                 "with `state_slots` but no `state_snapshots`")
            self.snapshots = Snapshots(state_slots, state_snapshots)

    def attach_states(self, pool) -> None:
        """The KV pool whose state pool's spare slots hold the snapshots (without: nothing to do)."""
        if self.snapshots is not None:
            self.snapshots.attach(getattr(pool, "states", None))

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
        """Fraction of blocks held by running sequences (cached free blocks count as free): the
        fullest group's."""
        return max(p.num_used / p.num_blocks for p in self.pools)

    def blocks_in_use(self) -> tuple[int, ...]:
        """Blocks held by running sequences, per group."""
        return tuple(p.num_used for p in self.pools)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def room(self, seq: KVSequence) -> int:
        """The position `seq` can grow to with the blocks free now, in the tightest group."""
        return (len(seq.block_ids) + min(p.num_free for p in self.pools)) * self.block_size

    # -- sequences ------------------------------------------------------------------------------

    def admit(self, seq: KVSequence, num_new: int, reserve: int = 0, max_cached: int | None = None) -> Admission | None:
        """Give a waiting sequence its cached prefix (at most `max_cached` tokens of it, for a caller
        that needs some rows computed, e.g. a prompt scored for its logprobs; never its last token,
        which must give logits) and blocks for up to `num_new` more tokens, keeping `reserve` blocks
        free (that share of each group); None (and nothing taken) when they do not fit (or no state
        slot is free)."""
        if self.states is not None and self.states.num_free == 0:
            return None
        tokens = seq.token_ids()
        hits = self._prefix_hits(seq, tokens, max_cached)
        host, tail = self._host_hits(seq, tokens, max_cached, len(hits[0]))  # the chain's next blocks, from the host
        snapshot = None
        if self.snapshots is not None:  # a hybrid's prefix ends where a snapshot of its state does
            hits, host, tail, snapshot = self._at_snapshot(seq, hits, host, tail)
        full = len(host) - (tail > 0)  # host payloads holding full blocks (a partial block comes last)
        cached = (len(hits[0]) + full) * self.block_size + tail
        num_new = min(num_new, len(tokens) - cached)
        fresh = self.blocks_for(cached + num_new) - len(hits[0])
        for g, pool in enumerate(self.pools):
            reclaimed = sum(1 for b in hits[g] if b is not None and pool.ref_count[b] == 0)  # hits now free
            keep = reserve if g == 0 else reserve * pool.num_blocks // self.pool.num_blocks
            if fresh + reclaimed + keep > pool.num_free:
                return None
        tables = []
        for g, pool in enumerate(self.pools):
            held = [b for b in hits[g] if b is not None]
            pool.share(held)
            tables.append([0] * (len(hits[g]) - len(held)) + held + pool.allocate(fresh))
        if len(host):  # copied in rather than computed, full blocks indexed like any computed block
            loaded = tables[0][len(hits[0]) : len(hits[0]) + len(host)]
            self.tier.load(loaded, host)
            for block, h in zip(loaded[:full], seq.block_hashes[len(hits[0]):], strict=False):
                self.pool.register(block, h)
        seq.block_ids, seq.group_tables = tables[0], tables[1:]
        seq.held_from = [len(h) - sum(b is not None for b in h) for h in hits]
        seq.num_cached_blocks = len(hits[0]) + full
        seq.num_computed = cached
        if self.states is not None:
            seq.state_slot = self.states.take()
            if snapshot is not None:
                self.snapshots.restore(snapshot, seq.state_slot, self.tier)
        return Admission(cached, len(tokens) if self.prefix_caching and max_cached != 0 else 0)

    def chunk(self, seq: KVSequence, n: int) -> int:
        """How many of the next `n` prompt tokens `seq` computes in this step: a hybrid's chunk ends
        on a block boundary, where its state can be snapshotted (workers/kv/snapshots.py), unless the
        boundary is behind it. The prompt's last chunk stops at its last boundary first (one more
        step for the rest) where the prompt is long, `LAST_BOUNDARY_BLOCKS` blocks or more, so that
        the next turn reuses it all even when the answer is not part of it (a template that drops
        the reasoning), or where another worker continues its KV (`publish_kv`)."""
        end = seq.num_computed + n
        if self.snapshots is None:
            return n
        if end == len(seq.token_ids()) and not getattr(seq, "publish_kv", False) and \
                end < LAST_BOUNDARY_BLOCKS * self.block_size:
            return n
        cut = end - end % self.block_size
        return cut - seq.num_computed if cut > seq.num_computed else n

    def grow(self, seq: KVSequence, end: int) -> bool:
        """Blocks for positions `< end` in every group; False when a group has too few free."""
        need = self.blocks_for(end) - len(seq.block_ids)
        if need <= 0:
            return True
        if any(need > p.num_free for p in self.pools):
            return False
        for g, pool in enumerate(self.pools):
            self._table(seq, g).extend(pool.allocate(need))
        return True

    def trim(self, seq: KVSequence, end: int) -> int:
        """Release the blocks past those holding positions `< end` in every group (tokens computed
        and then rejected, workers/engine/speculate.py); returns how many blocks of the first group
        were released. Blocks past `num_computed` were never indexed, so none is cached."""
        keep = self.blocks_for(end)
        released = max(0, len(seq.block_ids) - keep)
        for g, pool in enumerate(self.pools):
            table = self._table(seq, g)
            if len(table) > keep:
                pool.release(reversed(table[keep:]))
                del table[keep:]
        return released

    def slide(self, seq: KVSequence) -> None:
        """Free the blocks that a sliding group's window has left behind: those no query from
        position `num_computed` on reads (after `cache_full_blocks`, so they stay cached)."""
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            table, start = self._table(seq, g), seq.held_from[g]
            end = min(first_needed(window, seq.num_computed, self.block_size), len(table))
            if end > start:
                self.pools[g].release(table[start:end])
                seq.held_from[g] = end

    def swap_out(self, seq: KVSequence) -> bool:
        """Before a preemption frees `seq`'s blocks: every computed full block in the host tier (they
        were written through as they filled, unless the writer dropped one); `free` then writes the
        last, partly filled one, so that the resume reads them all back instead of recomputing
        them. False without a tier."""
        if self.tier is None or not self.prefix_caching or seq.num_computed == 0:
            return False
        full = seq.num_computed // self.block_size
        chain_hashes(self._root(seq), seq.token_ids()[: full * self.block_size], self.block_size, seq.block_hashes)
        for i in range(full):
            self.tier.cached(seq.block_ids[i], seq.block_hashes[i])
        return True

    def publish(self, seq: KVSequence) -> int:
        """Every computed block of a sequence that keeps running (or is about to move), the partly
        filled last one too, queued for the host tier now (workers/kvtier/publish.py waits for
        them); the tokens they hold, 0 without a tier."""
        if not self.swap_out(seq):
            return 0
        self._write_partial(seq)
        if self.snapshots is not None:
            self.snapshots.persist(seq, self.tier)
        return seq.num_computed

    def _write_partial(self, seq: KVSequence) -> None:
        """The sequence's last, partly filled block to the host tier, with the tokens it holds
        (a finished turn's last generated tokens, a preempted sequence's last ones): the next turn
        of the conversation, or the resume, reads it back instead of recomputing them."""
        full, n = divmod(seq.num_computed, self.block_size)
        if self.tier is None or not self.prefix_caching or n == 0 or len(seq.block_ids) <= full:
            return
        tokens = seq.token_ids()
        chain_hashes(self._root(seq), tokens[: full * self.block_size], self.block_size, seq.block_hashes)
        parent = seq.block_hashes[full - 1] if full else self._root(seq)
        self.tier.partial(seq.block_ids[full], parent, tokens[full * self.block_size : seq.num_computed])

    def free(self, seq: KVSequence) -> None:
        """Drop the sequence's blocks, last first: its cached prefix outlives its tail."""
        self._write_partial(seq)
        for g, pool in enumerate(self.pools):
            table = self._table(seq, g)
            start = seq.held_from[g] if g < len(seq.held_from) else 0
            pool.release(reversed(table[start:]))
        seq.block_ids, seq.group_tables, seq.held_from = [], [], []
        seq.num_cached_blocks = 0
        if self.states is not None and seq.state_slot >= 0:
            if self.snapshots is not None:  # its last boundary's state outlives it (a next turn, a resume)
                self.snapshots.persist(seq, self.tier)
                seq.snapshot_key = None
            self.states.give(seq.state_slot)
            seq.state_slot = -1

    def cache_full_blocks(self, seq: KVSequence) -> None:
        """Index the sequence's blocks that are now full and computed (after a step), in every group."""
        full = seq.num_computed // self.block_size
        if not self.prefix_caching or full <= seq.num_cached_blocks:
            return
        chain_hashes(self._root(seq), seq.token_ids()[: full * self.block_size], self.block_size, seq.block_hashes)
        for g, pool in enumerate(self.pools):
            table = self._table(seq, g)
            for i in range(max(seq.num_cached_blocks, seq.held_from[g] if g else 0), full):
                if pool.register(table[i], seq.block_hashes[i]) and self.tier is not None:
                    self.tier.cached(table[i], seq.block_hashes[i])  # written through to the host tier
        seq.num_cached_blocks = full
        if self.snapshots is not None and seq.num_computed == full * self.block_size:  # the state is at a boundary
            self.snapshots.save(seq, seq.block_hashes[full - 1], full, self.tier,
                                keep=seq.num_computed < len(seq.prompt_ids))  # a prompt chunk's end is kept

    def _table(self, seq: KVSequence, group: int) -> list[int]:
        return seq.block_ids if group == 0 else seq.group_tables[group - 1]

    def _root(self, seq: KVSequence) -> bytes:
        """The sequence's own hash root where its blocks' contents depend on more than the model and
        its tokens (a prompt whose length changes its rotation: workers/model/rope.py)."""
        return getattr(seq, "cache_root", None) or self.root

    def _host_hits(self, seq: KVSequence, tokens: list[int], max_cached: int | None, start: int) -> tuple:
        """The host tier's payloads of the blocks after the device's `start` cached ones (one group
        only), the last of them possibly the partly filled block after the last full hit; and how
        many of the prompt's tokens that partial block gives (0: every payload is a full block)."""
        if self.tier is None or not self.prefix_caching:
            return [], 0
        end = len(tokens) - 1 if max_cached is None else min(len(tokens) - 1, max_cached)
        limit = end // self.block_size
        hashes = seq.block_hashes[start:limit] if limit > start else []
        parent = (seq.block_hashes[start - 1] if start else self._root(seq)) if max_cached is None else None
        host, held = self.tier.fetch(hashes, parent)
        foreign = getattr(self.tier, "fetch_foreign", None)  # another KV dtype's blocks, cast exactly
        if foreign is not None and not len(host) and start == 0 and parent is not None and self._root(seq) == self.root:
            host, held = foreign(tokens, limit, lambda root, ids: chain_hashes(root, ids, self.block_size, []))
        if not held:
            return host, 0
        k = len(host) - 1  # full blocks found before the partial one
        pos = (start + k) * self.block_size
        n = 0
        for a, b in zip(held, tokens[pos:end], strict=False):  # the tokens it holds that this prompt shares
            if a != b:
                break
            n += 1
        return (host, n) if n else (host[:k], 0)

    def _at_snapshot(self, seq: KVSequence, hits: list, host, tail: int) -> tuple:
        """A hybrid's device and host hits cut back to the last block boundary with a snapshot of
        its linear layers' state, on the device or in the host tier (no partly filled block: the
        state would have to end inside it); with what restores that snapshot (None: no hit)."""
        found = len(hits[0]) + len(host) - (tail > 0)
        n, snapshot = self.snapshots.find(seq.block_hashes, found, self.tier)
        return [h[: min(n, len(h))] for h in hits], host[: max(0, n - len(hits[0]))], 0, snapshot

    def _prefix_hits(self, seq: KVSequence, tokens: list[int], max_cached: int | None) -> list[list[int | None]]:
        """Per group, the cached blocks holding the sequence's leading full blocks, before its last
        token (and within its first `max_cached` tokens): the longest prefix every group holds,
        a sliding group only the blocks its window reads from there (None before them)."""
        limit = (len(tokens) - 1 if max_cached is None else min(len(tokens) - 1, max_cached)) // self.block_size
        if not self.prefix_caching or limit == 0:
            return [[] for _ in self.pools]
        chain_hashes(self._root(seq), tokens[: limit * self.block_size], self.block_size, seq.block_hashes)
        hashes = seq.block_hashes[:limit]
        found = [[p.lookup(h) for h in hashes] for p in self.pools]  # per group: block or None
        n = next((i for i, b in enumerate(found[0]) if b is None), len(hashes)) if self.windows[0] is None else limit
        while n > 0:  # the longest prefix whose needed blocks every group holds
            need = [first_needed(w, n * self.block_size, self.block_size) for w in self.windows]
            if all(b is not None for g, f in enumerate(found) for b in f[need[g] : n]):
                return [[None] * need[g] + f[need[g] : n] for g, f in enumerate(found)]
            n -= 1
        return [[] for _ in self.pools]
