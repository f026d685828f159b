"""A worker's host tier: its blocks copied out of the device pool when cached, and back in on a hit.

Design: write-through. When the block manager indexes a full block (workers/kv/manager.py
`cache_full_blocks`), `cached` copies it out of the pool (one strided copy per block) and the
writer thread stores it (workers/kvtier/writer.py); when a prefix lookup has taken what the
device cache holds, `fetch` reads the chain's following blocks from the tier (checked by the
store) and `load` copies them into freshly allocated device blocks, so the scheduler starts the
sequence past them. The alternative, writing a block only when the device pool evicts it, writes
less, but a block held on one worker's device would be invisible to the others, and a worker
killed with -9 would take every block it had not evicted yet with it; written through, a second
worker continues a conversation the first still holds, and a dead worker's blocks stay reusable.
A sequence's last, partly filled block is written when it stops holding it (`partial`: finished
or preempted) with the tokens it holds, keyed by the block before it, and a lookup takes it as far
as the new prompt shares those tokens: a conversation's next turn and a preempted sequence's
resume compute only what no one computed. Trade-off: every full block is copied once and
written once, whether or not it is ever evicted (a block already in the tier is not written
again); the copy is on the step's path, its checksum and file are not. On the CPU the copy is a
plain copy. On a GPU it runs on the tier's own CUDA stream into pinned memory and the engine
thread does not wait for it: the writer thread waits for its event, and the compute stream
waits for the last copy before the next step's forward, so a block is never rewritten while it
is copied (`_copy_out`); a partly filled block, once per sequence, is copied synchronously.
`fetch` reads on the engine thread, each file straight into one staging buffer (pinned on a GPU)
copied into the pool at once: a hit is a file read and a copy, where a miss would be that
block's prefill."""

from __future__ import annotations

import hashlib
import logging
import math
from array import array
from collections.abc import Callable
from pathlib import Path

import torch

from workers.contract import KV_HOST_SHARE, WorkerConfig
from workers.kvtier.foreign import ForeignReader, foreign_formats
from workers.kvtier.format import KVFormat, format_of, model_fingerprint, partial_key, state_key, unsupported
from workers.kvtier.store import TierStore, default_budget
from workers.kvtier.writer import TierWriter

logger = logging.getLogger(__name__)


class HostTier:
    """The tier one worker reads and writes (`enabled`), or why it has none (`reason`)."""

    def __init__(self, pool, fmt: KVFormat | None, store: TierStore | None, reason: str | None) -> None:
        self.pool, self.format, self.store = pool, fmt, store
        self.reason = reason if reason is not None else (store.reason if store is not None else None)
        self.enabled = store is not None and store.enabled and self.reason is None
        self.writer = TierWriter(self._put) if self.enabled else None
        self._partials: set[bytes] = set()  # keys of partly filled blocks queued: written over older ones
        self.blocks_loaded = self.tails_loaded = 0
        self._pinned = torch.device(getattr(pool, "device", "cpu")).type == "cuda" and torch.cuda.is_available()
        # a GPU's blocks go out on their own stream into pinned memory (`_copy_out`); None on the CPU
        self._copy_stream = torch.cuda.Stream(device=pool.device) if self._pinned and self.enabled else None
        self._fence = None  # the copy stream's last event: the compute stream waits for it before the next step
        self._last: tuple[tuple, tuple] = ((), (torch.empty(0, dtype=torch.uint8), []))  # for a retry
        self.foreign: ForeignReader | None = None  # other dtypes' blocks, converted exactly (workers/kvtier/foreign.py)
        self._last_state: tuple = (None, None)  # the last snapshot fetched (a waiting sequence asks each step)
        self.states_written = self.states_loaded = 0

    @classmethod
    def open(cls, pool, root: bytes, directory: str | Path | None, budget: int,
             prefix_caching: bool = True) -> HostTier:
        """The tier of `pool`'s format (hash `root`) under `directory` within `budget` bytes; one
        that is off, with the reason, when there is no directory, no budget, or a pool it cannot serve."""
        if directory is None:
            return cls(pool, None, None, "no tier directory (the router makes one; `--kv-host-dir`)")
        why = unsupported(pool, prefix_caching)
        if why is not None:
            return cls(pool, None, None, why)
        fmt = format_of(pool, root)
        store = TierStore(directory, budget, fmt.key)
        if store.enabled:
            logger.info("host KV tier at %s: %s bytes budget, format %s", store.dir, budget, fmt.describe())
        else:
            logger.warning("host KV tier off: %s", store.reason)
        return cls(pool, fmt, store, None)

    @classmethod
    def for_worker(cls, config: WorkerConfig, pool, root: bytes, prefix_caching: bool,
                   model_dir: str | Path, chain_root_for: Callable[[torch.dtype], bytes] | None = None) -> HostTier:
        """The tier `config` asks for (`--kv-host-dir`, `--kv-host-bytes`; default budget: a share of
        MemAvailable now), keyed by the prefix cache's `root`, the checkpoint in `model_dir` and the
        numerics (workers/kvtier/format.py); with `chain_root_for` (the prefix cache's root had the
        KV been of another dtype) it also reads the formats that differ only by dtype, converted
        exactly (workers/kvtier/foreign.py)."""
        budget = config.kv_host_bytes if config.kv_host_bytes is not None else default_budget(KV_HOST_SHARE)
        numerics = "deterministic" if config.deterministic else "default"

        def identity_for(chain_root: bytes) -> bytes:
            return hashlib.sha256(b"\x1f".join((chain_root, model_fingerprint(model_dir).encode(),
                                                numerics.encode()))).digest()

        tier = cls.open(pool, identity_for(root), config.kv_host_dir, budget, prefix_caching)
        if tier.enabled and chain_root_for is not None and pool.states is None:  # a hybrid's state has one dtype
            formats = foreign_formats(tier.format, pool.dtype, config.kv_host_dir, chain_root_for, identity_for)
            tier.foreign = ForeignReader(tier.format, pool.dtype, formats) if formats else None
        return tier

    # -- the block manager's hooks (workers/kv/manager.py) --------------------------------------

    def cached(self, block: int, chain_hash: bytes) -> None:
        """A block became full and indexed on the device: copy it out now, store it after the step."""
        if self.store.contains(chain_hash) or self.writer.peek(chain_hash) is not None:
            return
        data, done = self._copy_out(block)
        view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
        self.writer.submit(chain_hash, view if done is None else (view, done), wake=False)

    def _copy_out(self, block: int) -> tuple[torch.Tensor, object]:
        """Device block `block` in host memory, always a copy (the device block is reused later), and
        the event that says it is there (None: it is). On the CPU a plain copy. On a GPU the copy
        runs on the tier's own stream, after the compute stream's work so far (which wrote the
        block), into pinned memory, without waiting: the writer thread (or a lookup served from
        the queue) waits for the event before reading it, and the compute stream waits for the
        last one at the next `write_behind`, before any later step may write into the block."""
        src = self.pool.tensors[0][:, :, :, block]  # [L, 2, Hkv, B, D] on the device
        if self._copy_stream is None:
            data = torch.empty(self.format.block_shape, dtype=self.pool.dtype)
            data.copy_(src)
            return data, None
        data = torch.empty(self.format.block_shape, dtype=self.pool.dtype, pin_memory=True)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(self._copy_stream):
            data.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        self._fence = done
        return data, done

    @staticmethod
    def _on_host(payload):
        """A queued payload readable on the host: a GPU copy's event waited for first."""
        if isinstance(payload, tuple):
            view, done = payload
            done.synchronize()
            return view
        return payload

    def partial(self, block: int, parent: bytes, tokens: list[int]) -> None:
        """A sequence stops holding a partly filled block (it finished or was preempted): copy it
        out with the `tokens` it holds, keyed by the full block before it (`partial_key`); a
        newer one after the same block replaces it."""
        key = partial_key(parent)
        data = torch.empty(self.format.block_shape, dtype=self.pool.dtype)  # [L, 2, Hkv, B, D] in host memory
        data.copy_(self.pool.tensors[0][:, :, :, block])
        payload = bytearray(data.reshape(-1).view(torch.uint8).numpy().tobytes())
        payload += array("q", tokens).tobytes()
        self._partials.add(key)  # kept if the writer refuses it: a later write of this key replaces too
        self.writer.submit(key, memoryview(payload), wake=False)

    def _put(self, chain_hash: bytes, payload) -> bool:
        """The writer's store: a partly filled block replaces an older one under its key."""
        replace = chain_hash in self._partials
        self._partials.discard(chain_hash)
        return self.store.put(chain_hash, self._on_host(payload), replace=replace)

    # -- a hybrid's state snapshots (workers/kv/snapshots.py) ------------------------------------

    def put_state(self, key: bytes, slot: int) -> None:
        """A snapshot of the linear layers' state (`slot` of the state pool) at the end of the block
        hashing to `key`: copied out now (the recurrent state, then the conv window), written behind.
        On a GPU the copy runs on the tier's stream and the engine thread does not wait for it (as
        `_copy_out`); the compute stream does, before anything reuses the slot."""
        skey = state_key(key)
        if self.store.contains(skey) or self.writer.peek(skey) is not None:
            return
        states = self.pool.states
        parts = (states.recurrent[:, slot], states.conv[:, slot])  # [L, Hv, Dk, Dv] fp32, [L, C, K-1]
        if self._copy_stream is None:  # the CPU: a plain copy
            payload = memoryview(torch.cat([p.reshape(-1).view(torch.uint8) for p in parts]).numpy())
        else:  # a GPU: on the copy stream into pinned memory; the compute stream, not the host, waits
            data = torch.empty(self.format.state_bytes, dtype=torch.uint8, pin_memory=True)
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(self._copy_stream):
                start = 0
                for p in parts:
                    size = p.numel() * p.element_size()
                    data[start : start + size].view(p.dtype).view(p.shape).copy_(p, non_blocking=True)
                    start += size
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            torch.cuda.current_stream(self.pool.device).wait_event(done)  # the slot may be reused next
            payload = (memoryview(data.numpy()), done)
        self.writer.submit(skey, payload, wake=False)
        self.states_written += 1

    def fetch_state(self, key: bytes):
        """The snapshot at the end of the block hashing to `key`, checked (queued or stored), or
        None. A sequence that did not fit asks again each step: the last answer is kept."""
        if self._last_state[0] == key:
            return self._last_state[1]
        skey = state_key(key)
        payload = self._on_host(self.writer.peek(skey))
        if payload is None and self.store.contains(skey):
            payload = self.store.get(skey)
        if payload is not None and len(payload) != self.format.state_bytes:
            payload = None
        self._last_state = (key, payload)
        return payload

    def load_state(self, payload, slot: int) -> None:
        """Copy a fetched snapshot into the state pool's running slot `slot`."""
        states, (recurrent, _, conv, _) = self.pool.states, self.format.state
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        n = math.prod(recurrent) * states.recurrent.element_size()
        states.recurrent[:, slot].copy_(data[:n].view(states.recurrent.dtype).view(recurrent))
        states.conv[:, slot].copy_(data[n:].view(states.conv.dtype).view(conv))
        self._last_state = (None, None)
        self.states_loaded += 1

    def write_behind(self) -> None:
        """Called once a step is scheduled: the writer writes what earlier steps cached while this
        one computes (its forward releases the interpreter lock) or the engine idles
        (workers/kvtier/writer.py)."""
        if self._fence is not None:  # no step writes a device block before its copy out is done
            torch.cuda.current_stream(self.pool.device).wait_event(self._fence)
            self._fence = None
        if self.writer is not None:
            self.writer.wake()

    def fetch(self, hashes: list[bytes], parent: bytes | None = None) -> tuple[torch.Tensor, list[int]]:
        """The payloads of the leading blocks of `hashes` the tier holds (stopping at the first it
        does not: a block past a gap is useless without the one before), then, with `parent` (the
        hash before `hashes[0]`), the partly filled block written after the last of them, if any
        (`partial`), as one uint8 staging buffer `[K, block bytes]` (pinned on a GPU) that each
        file is read straight into; and the tokens that partial block holds ([] without one). A
        sequence that did not fit waits at the head of the queue and asks again each step: its
        last answer is kept."""
        key = (*hashes, parent)
        if key == self._last[0]:
            return self._last[1]
        n = self.format.block_bytes
        buf = torch.empty((len(hashes) + 1, n), dtype=torch.uint8, pin_memory=self._pinned)
        flat = memoryview(buf.numpy()).cast("B")
        k = 0
        for h in hashes:
            row = flat[k * n : (k + 1) * n]
            payload = self._on_host(self.writer.peek(h))
            if payload is not None and len(payload) == n:
                row[:] = payload  # still queued for writing: served from memory
            elif not self.store.read_into(h, row):
                break
            k += 1
        held: list[int] = []
        if parent is not None:
            pkey = partial_key(hashes[k - 1] if k else parent)
            payload = self.writer.peek(pkey)
            if payload is None and self.store.contains(pkey):  # (its absence is not counted as a miss)
                payload = self.store.get(pkey)
            if payload is not None and len(payload) > n and (len(payload) - n) % 8 == 0:
                flat[k * n : (k + 1) * n] = memoryview(payload)[:n]
                held = array("q", bytes(memoryview(payload)[n:])).tolist()
        out = (buf[: k + (1 if held else 0)], held)
        self._last = (key, out)
        return out

    def fetch_foreign(self, tokens: list[int], limit: int, chain) -> tuple[torch.Tensor, list[int]]:
        """As `fetch`, from the formats that differ from this one only by dtype, when this one holds
        nothing of the prompt (workers/kvtier/foreign.py): `tokens` the prompt, `limit` its full
        blocks that may be read, `chain(root, ids)` their hashes under another root; empty without
        such formats or blocks."""
        key = ("foreign", tuple(tokens[: (limit + 1) * self.format.block_size]))
        if key == self._last[0]:
            return self._last[1]
        found = self.foreign.fetch(tokens, limit, chain) if self.foreign is not None else None
        out = found if found is not None else (torch.empty(0, dtype=torch.uint8), [])
        self._last = (key, out)
        return out

    def load(self, blocks: list[int], payloads: torch.Tensor) -> None:
        """Copy fetched payloads (`fetch`'s buffer) into the device blocks `blocks`: one indexed copy."""
        fetched, held = self._last[1]
        self._last = ((), (torch.empty(0, dtype=torch.uint8), []))
        if not blocks:
            return
        if held and len(blocks) == len(fetched):  # the fetch's partial block is loaded too
            self.tails_loaded += 1
        data = payloads[: len(blocks)].view(self.pool.dtype)
        data = data.view(len(blocks), *self.format.block_shape)  # [K, L, 2, Hkv, B, D]
        index = torch.tensor(blocks, dtype=torch.long, device=self.pool.device)
        src = data.permute(1, 2, 3, 0, 4, 5).to(self.pool.device, non_blocking=True)  # from pinned memory on a GPU
        self.pool.tensors[0].index_copy_(3, index, src)
        self.blocks_loaded += len(blocks)

    # -- life and description -------------------------------------------------------------------

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def describe(self) -> dict:
        """`/capability` `kv_host_tier`: directory, bytes used of the budget, hits, blocks written and
        loaded, or the reason it is off."""
        if self.store is None:
            return {"enabled": False, "reason": self.reason}
        out = self.store.describe()
        out.update(enabled=self.enabled, blocks_loaded=self.blocks_loaded, partial_blocks_loaded=self.tails_loaded,
                   blocks_dropped=self.writer.dropped if self.writer else 0)
        if self.format is not None and self.format.state:
            out.update(state_snapshots_written=self.states_written, state_snapshots_loaded=self.states_loaded)
        if self.format is not None:
            out["format"] = self.format.describe()
            out["format_key"] = self.format.key.hex()[:16]
        if self.reason:
            out["reason"] = self.reason
        if self.foreign is not None:
            out["foreign"] = self.foreign.describe()
        return out
