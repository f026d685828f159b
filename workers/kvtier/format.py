"""A worker's KV format: what must match for one worker to read another's blocks, as one key.

Design: the key is a digest of the prefix cache's hash root (the model's name, its dtype, the
quantization and the block size: workers/engine/build.py `scheduler_config`) extended by the
checkpoint's fingerprint (`model_fingerprint`) and the numerics (`--deterministic` computes its
K/V in other tiles), the pool's layout, every group's shape (layers, KV heads, head dim) and the
KV dtype. Two workers of
the same model and format compute the same key and so share the tier's blocks; any difference
gives another key, whose blocks are invisible to the first (another directory) and refused if
met anyway (the store checks the key in each block's header). No silent conversion between
formats: a block is read as it is only by a worker that would have computed the same bytes; a
format that differs only by KV dtype is read through an exact cast or not at all
(workers/kvtier/foreign.py).
Which pools the tier serves: one full-attention group, and a hybrid's linear layers' state through
its snapshots at block boundaries (workers/kv/snapshots.py; their shapes are part of the key). A
sliding group's blocks are not chained per block here, so such a model gets no tier, with the
reason; a hybrid whose prefix cache is off (so it takes no snapshots) neither, its reason stating
the bytes one snapshot would take."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

LAYOUT = "hetserve-kv-v1:[layers,2,kv_heads,block,head_dim]"  # workers/kv/pool.py, per block
STATE_LAYOUT = "hetserve-state-v1:recurrent[layers,heads,key_dim,value_dim],conv[layers,channels,kernel-1]"


@dataclass(frozen=True)
class KVFormat:
    """The format of one worker's KV blocks and the shape of one block's payload."""

    root: bytes  # the prefix cache's hash root (model identity, dtype, quantization, block size)
    dtype: str
    block_size: int
    block_shape: tuple[int, ...]  # one block's payload: [layers, 2, kv_heads, block_size, head_dim]
    element_size: int
    state: tuple = ()  # a hybrid's snapshot: (recurrent shape, its dtype, conv shape, its dtype), one sequence

    @property
    def key(self) -> bytes:
        parts = (self.root.hex(), self.dtype, str(self.block_size), LAYOUT, repr(self.block_shape))
        text = "\x1f".join(parts + ((STATE_LAYOUT, repr(self.state)) if self.state else ()))
        return hashlib.sha256(text.encode()).digest()

    @property
    def block_bytes(self) -> int:
        n = self.element_size
        for s in self.block_shape:
            n *= s
        return n

    @property
    def state_bytes(self) -> int:
        """One snapshot's payload: the recurrent state, then the conv window (0: not a hybrid)."""
        if not self.state:
            return 0
        recurrent, r_size, conv, c_size = self.state
        return math.prod(recurrent) * r_size + math.prod(conv) * c_size

    def describe(self) -> str:
        layers, _, heads, block, dim = self.block_shape
        out = f"{self.dtype}, {layers} layers x {heads} KV heads x {dim}, blocks of {block} tokens"
        return out + (f", state snapshots of {self.state_bytes} bytes" if self.state else "")


WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def model_fingerprint(model_dir: str | Path) -> str:
    """The model's identity beyond its name: its directory, resolved, and each weight file's name,
    size and modification time. Two checkpoints that share a name (`_name_or_path`, a directory
    called `model`) but not their weights never share blocks; stat calls only, no hashing of
    gigabytes at start. Trade-off: a checkpoint copied elsewhere, or touched, is another model."""
    root = Path(model_dir).resolve()
    parts = [str(root)]
    try:
        for f in sorted(root.iterdir()):
            if f.suffix in WEIGHT_SUFFIXES and f.is_file():
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    except OSError:
        pass  # a single-file checkpoint (a .gguf path): its own stat below
    if root.is_file():
        st = root.stat()
        parts.append(f"{st.st_size}:{st.st_mtime_ns}")
    return "\x1f".join(parts)


def unsupported(pool, prefix_caching: bool) -> str | None:
    """Why the tier cannot serve this pool (None: it can). A hybrid's reason comes first (its prefix
    cache is off because of its state, not a flag) and states the size of the snapshot it lacks."""
    if pool.states is not None and not prefix_caching:
        return hybrid_reason(pool)
    if not prefix_caching:
        return "the prefix cache is off (`--no-prefix-cache`): blocks have no chain hashes to key them"
    if len(pool.groups) != 1 or pool.groups[0].window is not None:
        return "sliding-window or several KV groups: this tier serves one full-attention group only"
    if any(s != i for i, s in enumerate(pool.sources)):
        return "layers that share another layer's KV: this tier serves one full-attention group only"
    return None


def hybrid_reason(pool) -> str:
    """Why a model with linear-attention layers gets no tier, with the bytes of the snapshot that
    reusing a prefix would need at each boundary (one sequence's whole state: conv and recurrent
    state of every linear layer) against one KV block of its attention layers."""
    states = pool.states
    snapshot = states.nbytes // states.num_slots
    kv = pool.tensors[0]  # [L, 2, Hkv, blocks, B, D]
    block = kv[:, :, :, 0].numel() * kv.element_size() if kv.dim() == 6 else 0
    per = f", {snapshot / block:.2g}x one KV block ({block} bytes)" if block else ""
    return (f"the prefix cache is off, so linear-attention state is not snapshotted (one snapshot is {snapshot} "
            f"bytes{per}; `--no-prefix-cache`, a pipeline stage or no room for snapshot slots): a hybrid's prefix "
            "is recomputed and it has no host tier (workers/kv/snapshots.py)")


def format_of(pool, root: bytes) -> KVFormat:
    """The format of `pool`'s blocks (a `KVPool` with one group) under the hash `root`."""
    layers, two, heads, _, block, dim = pool.tensors[0].shape
    state = ()
    if pool.states is not None:  # [L, S, Hv, Dk, Dv] fp32 and [L, S, C, K-1]: one slot's shapes
        r, c = pool.states.recurrent, pool.states.conv
        state = ((r.shape[0], *r.shape[2:]), r.element_size(), (c.shape[0], *c.shape[2:]), c.element_size())
    return KVFormat(root, str(pool.dtype).removeprefix("torch."), pool.block_size, (layers, two, heads, block, dim),
                    pool.tensors[0].element_size(), state)


def state_key(chain_hash: bytes) -> bytes:
    """The key of a hybrid's state snapshot at the end of the block whose chain hash is `chain_hash`."""
    return hashlib.sha256(b"state after\x1f" + chain_hash).digest()


def partial_key(parent: bytes) -> bytes:
    """The key of the partly filled block that follows the full block whose chain hash is `parent`
    (the hash root for a first block): one per parent, the tokens it holds stored with it, since
    a lookup does not know how many a sequence had computed there (workers/kvtier/tier.py)."""
    return hashlib.sha256(b"partial block after\x1f" + parent).digest()
