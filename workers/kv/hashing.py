"""Block hashes for automatic prefix caching: what a full KV block holds, as one digest.

A full block's K/V depend on every token before it, not just its own, so its hash is chained:
`h_i = sha256(h_{i-1} || token ids of block i)`, and the chain starts from a root digest of
everything else that changes the contents (the model, its dtype, the quantization, the block
size). Two requests share block `i` exactly when they share tokens `0 .. (i+1)*B - 1` and
that root. Trade-off: sha256 costs more than Python's `hash()`, once per block per sequence, but
a collision would hand one request another request's context, and `hash()` on tuples of ints
can be collided on purpose (vLLM made the same change)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def root_hash(*parts: object) -> bytes:
    """The chain's start: a digest of what, besides the tokens, decides a block's contents."""
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block, chained on its parent's (the root for the first block)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def chain_hashes(root: bytes, token_ids: Sequence[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """Extend `known` (hashes of the first blocks, in place) to every full block of `token_ids`."""
    for i in range(len(known), len(token_ids) // block_size):
        known.append(block_hash(known[-1] if known else root, token_ids[i * block_size : (i + 1) * block_size]))
    return known
