"""Reading the blocks that workers of another KV dtype wrote, converted only where exact.

On a mixed host the worker that prefilled a prompt may keep KV in bf16 (an sm_80) and the one
that decodes it in fp16 (an sm_75): the same model, block size, layout and shape, another dtype,
so another format key, another chain of block hashes (the hash root names the dtype) and another
directory of the tier. Design: a worker's tier knows the formats that differ from its own only by
dtype (`foreign_formats`: each one's chain root, computed as that worker would, and its store);
when its own format holds nothing of a prompt, `ForeignReader.fetch` walks the prompt's chain
under each of them, reads the leading blocks (and the partly filled block after them), and casts
each to its own dtype through `exact_cast` (workers/kvtier/convert.py): a block whose cast is not
exact ends the read there, with the reason logged and counted, and the rest of the prompt is
recomputed. Nothing is ever written in another format's directory. Trade-off: a foreign read
happens only where the own format found nothing at the prompt's start, and it reads and converts
on the engine thread, the cost of the cast and its proof besides the file read.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from workers.kvtier.convert import exact_cast
from workers.kvtier.format import KVFormat, partial_key
from workers.kvtier.store import TierStore

logger = logging.getLogger(__name__)

KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the dtypes a pool may keep its KV in


@dataclass(frozen=True)
class ForeignFormat:
    """Another worker's format: its KV dtype, the root of its chain of block hashes, its blocks."""

    dtype: torch.dtype
    chain_root: bytes
    format: KVFormat
    store: TierStore


def foreign_formats(own: KVFormat, own_dtype: torch.dtype, directory, chain_root_for: Callable[[torch.dtype], bytes],
                    identity_for: Callable[[bytes], bytes]) -> list[ForeignFormat]:
    """The formats that differ from `own` only by dtype: `chain_root_for(dtype)` is the hash root
    such a worker's prefix cache uses, `identity_for(root)` the identity its tier keys its format by."""
    out = []
    for dtype in KV_DTYPES:
        if dtype == own_dtype:
            continue
        root = chain_root_for(dtype)
        fmt = KVFormat(identity_for(root), str(dtype).removeprefix("torch."), own.block_size, own.block_shape,
                       torch.empty((), dtype=dtype).element_size())
        store = TierStore(directory, 1, fmt.key)  # read only: a budget that never evicts anything of its own
        if store.enabled:
            out.append(ForeignFormat(dtype, root, fmt, store))
    return out


class ForeignReader:
    """The foreign side of one worker's prefix lookup (see the module docstring)."""

    def __init__(self, own: KVFormat, own_dtype: torch.dtype, formats: Sequence[ForeignFormat]):
        self.own, self.own_dtype, self.formats = own, own_dtype, list(formats)
        self.blocks_converted = self.casts_refused = 0
        self.last_refusal: str | None = None

    def fetch(self, tokens: Sequence[int], limit: int,
              chain: Callable[[bytes, list[int]], list[bytes]]) -> tuple[torch.Tensor, list[int]] | None:
        """The leading blocks of `tokens` (at most `limit` full ones, then the partly filled one
        after them) that another format holds, converted exactly into this worker's dtype, as one
        uint8 buffer `[K, block bytes]`, and the tokens the partial block holds ([] without one);
        None when no other format holds the prompt's first block. `chain(root, ids)`: the hashes
        of the full blocks of `ids` under `root` (the prefix cache's, workers/kv/hashing.py)."""
        bs = self.own.block_size
        for f in self.formats:
            hashes = chain(f.chain_root, list(tokens[: limit * bs]))
            payloads = []
            for h in hashes:
                payload = f.store.get(h)
                if payload is None:
                    break
                payloads.append(payload)
            held: list[int] = []
            pkey = partial_key(hashes[len(payloads) - 1] if payloads else f.chain_root)
            n = f.format.block_bytes
            if f.store.contains(pkey):
                tail = f.store.get(pkey)
                if tail is not None and len(tail) > n and (len(tail) - n) % 8 == 0:
                    payloads.append(tail[:n])
                    held = array("q", tail[n:]).tolist()
            if payloads:
                return self._converted(f, payloads, held)
        return None

    def _converted(self, f: ForeignFormat, payloads: list[bytes], held: list[int]) -> tuple[torch.Tensor, list[int]]:
        """The payloads cast into this worker's dtype, up to the first whose cast is not exact."""
        out = torch.empty((len(payloads), self.own.block_bytes), dtype=torch.uint8)
        for i, payload in enumerate(payloads):
            block = torch.frombuffer(bytearray(payload), dtype=f.dtype)
            cast = exact_cast(block, self.own_dtype)
            if not cast.exact:
                self.blocks_converted += i
                self.casts_refused += 1
                self.last_refusal = f"{f.format.dtype} -> {self.own.dtype}: {cast.reason}"
                logger.warning("host KV tier: block %d of a prompt written as %s is recomputed, its cast is not "
                               "exact (%s)", i, f.format.dtype, cast.reason)
                return out[:i], []  # the blocks after it (the partial one too) are recomputed
            out[i] = cast.block.view(torch.uint8)
        self.blocks_converted += len(payloads)
        return out, held

    def describe(self) -> dict:
        return {"formats": [f.format.dtype for f in self.formats], "blocks_converted": self.blocks_converted,
                "casts_refused": self.casts_refused, "last_refusal": self.last_refusal}
