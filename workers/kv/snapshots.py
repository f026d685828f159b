"""Snapshots of the linear layers' state at block boundaries: what lets a hybrid reuse a prefix.

Design: a Gated DeltaNet layer's state after a token sums every token before it, so a hybrid's
cached prefix is usable only together with the state at exactly its end. The chunked kernels give
the state at the end of a step only, so a snapshot is taken when a step ends on a block boundary
(the scheduler ends a hybrid's prompt chunks there: `KVCacheManager.chunk`)
and is keyed by the chain hash of the block it ends (workers/kv/hashing.py), which covers every
token before it and the model's identity. Policy, per sequence:
- kept: the end of each prompt chunk before the prompt's last (every `--max-num-batched-tokens`
  or so of a long prompt: a shared prefix longer than a chunk is reused up to its last chunk
  end), every `INTERVAL_BLOCKS` blocks, and the last block boundary of a prompt of
  `LAST_BOUNDARY_BLOCKS` blocks or more, whose prefill stops there for one more step over the
  rest: the next turn reuses the whole prompt even where the template drops the answer's
  reasoning from the history, at the price of one short step on a long prompt's first token;
- rolling: any other boundary it reaches (a decode every `block_size` tokens) replaces its
  previous rolling snapshot, so when it stops (a turn's end, a preemption, a handoff) the state
  at its last boundary is left behind: the next turn or the resume recomputes under one block.
Snapshots live in spare slots of the state pool (`StatePool`, after the running sequences'
slots), least recently used evicted. With a host tier, kept snapshots and a sequence's last one
when it stops are written there too (workers/kvtier/tier.py `put_state`) and read back on a device
miss, so another worker of the same format continues the conversation.
Trade-off: one snapshot is a whole sequence's state (every linear layer's conv window and fp32
recurrent state), tens to hundreds of KV blocks' worth, so boundaries are sparse; a prefix shared
only up to a point inside a step (two prompts with one system prompt, each prefilled in one step)
has no snapshot there and is recomputed: the kernels would have to emit the state mid-chunk."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

INTERVAL_BLOCKS = 16  # a kept snapshot every this many blocks of a sequence
LAST_BOUNDARY_BLOCKS = 16  # a prompt this long stops at its last block boundary, snapshotted, first
PER_SEQUENCE = 2  # snapshot slots per running sequence (its rolling one and room for kept ones)
SHARE = 0.25  # of the KV budget, at most, for snapshot slots


class StateTier(Protocol):
    """The host tier's side (workers/kvtier/tier.py `HostTier`)."""

    def put_state(self, key: bytes, slot: int) -> None: ...
    def fetch_state(self, key: bytes) -> object | None: ...
    def load_state(self, payload: object, slot: int) -> None: ...


def plan_snapshots(per_state: int, max_sequences: int, budget: int) -> int:
    """Snapshot slots for `max_sequences` running sequences whose state is `per_state` bytes each:
    `PER_SEQUENCE` each, within `SHARE` of the KV `budget` (0: none fits, no hybrid prefix cache)."""
    if not per_state:
        return 0
    return max(0, min(PER_SEQUENCE * max_sequences, int(budget * SHARE) // per_state))


class Snapshots:
    """Which state snapshot is in which spare slot (`first` .. `first + count - 1` of the state
    pool); the pool, attached by the engine, copies them."""

    def __init__(self, first: int, count: int) -> None:
        if first < 1 or count < 1:
            raise ValueError(f"Snapshots need running slots and spare slots, got `first` {first}, `count` {count}")
        self.first, self.count = first, count
        self.pool = None  # the `StatePool` whose slots these are (`attach`)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._kept: set[bytes] = set()
        self._free = list(range(first + count - 1, first - 1, -1))
        self.taken = self.restored = self.from_host = self.evicted = 0

    def attach(self, pool) -> None:
        if pool is None or pool.num_slots < self.first + self.count:
            raise ValueError(f"State snapshots need a state pool of {self.first + self.count} slots, got "
                             f"`{None if pool is None else pool.num_slots}`")
        self.pool = pool

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def save(self, seq, key: bytes, blocks: int, tier: StateTier | None = None, keep: bool = False) -> None:
        """`seq`'s state (its slot) is now at the end of its first `blocks` blocks, the last one
        hashing to `key`: keep a copy, rolling unless `keep` (a prompt chunk's end) or at every
        `INTERVAL_BLOCKS`; a kept one goes to the host tier too."""
        keep = keep or blocks % INTERVAL_BLOCKS == 0
        if key in self._slots:  # the same tokens' state is there already
            self._slots.move_to_end(key)
        else:
            old = seq.snapshot_key
            if old is not None and old in self._slots and old not in self._kept:
                slot = self._slots.pop(old)  # its rolling snapshot moves on
            elif self._free:
                slot = self._free.pop()
            else:
                evicted, slot = self._slots.popitem(last=False)
                self._kept.discard(evicted)
                self.evicted += 1
            self.pool.copy_slot(seq.state_slot, slot)
            self._slots[key] = slot
            self.taken += 1
        if keep and key not in self._kept:
            self._kept.add(key)
            if tier is not None:
                tier.put_state(key, self._slots[key])
        seq.snapshot_key = key

    def persist(self, seq, tier: StateTier | None) -> None:
        """`seq` stops (finished, preempted, handed off): its last snapshot to the host tier."""
        key = seq.snapshot_key
        if tier is not None and key is not None and key in self._slots and key not in self._kept:
            tier.put_state(key, self._slots[key])

    def find(self, hashes: list[bytes], limit: int, tier: StateTier | None) -> tuple[int, tuple | None]:
        """The most leading blocks of `hashes` (at most `limit`) whose end has a snapshot, on the
        device or else in the host tier (read and checked now), and what restores it (0, None: none)."""
        for n in range(min(limit, len(hashes)), 0, -1):
            key = hashes[n - 1]
            if key in self._slots:
                return n, (key, None)
            payload = tier.fetch_state(key) if tier is not None else None
            if payload is not None:
                return n, (key, payload)
        return 0, None

    def restore(self, found: tuple, slot: int, tier: StateTier | None) -> None:
        """Copy the snapshot `find` gave into the running slot `slot`."""
        key, payload = found
        if payload is None:
            self._slots.move_to_end(key)
            self.pool.copy_slot(self._slots[key], slot)
        else:
            tier.load_state(payload, slot)
            self.from_host += 1
        self.restored += 1

    def describe(self) -> dict:
        """`/capability` `capacity` `state_snapshots`: slots, held, and how often each path ran."""
        each = None if self.pool is None else self.pool.nbytes // self.pool.num_slots
        return {"slots": self.count, "held": len(self._slots), "bytes_each": each, "every_blocks": INTERVAL_BLOCKS,
                "taken": self.taken, "restored": self.restored, "from_host_tier": self.from_host,
                "evicted": self.evicted}
