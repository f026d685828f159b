"""The paged KV cache: block memory (`pool`), the allocator with its prefix-cache index
(`blocks`), per-sequence block tables (`manager`), chained block hashes (`hashing`), the
batch description one model step runs over them (`batch`) and the CPU decode path's
contiguous copy of the decoding rows (`mirror`)."""

from workers.kv.batch import DecodeRows, ForwardBatch, PrefillSpan, SeqChunk, gather_kv
from workers.kv.blocks import BlockPool
from workers.kv.hashing import block_hash, chain_hashes, root_hash
from workers.kv.manager import Admission, KVCacheManager
from workers.kv.mirror import DecodeMirror, MirrorRows, attend_rows
from workers.kv.pool import KVPool

__all__ = [
    "Admission", "BlockPool", "DecodeMirror", "DecodeRows", "ForwardBatch", "KVCacheManager", "KVPool",
    "MirrorRows", "PrefillSpan", "SeqChunk", "attend_rows", "block_hash", "chain_hashes", "gather_kv", "root_hash",
]
