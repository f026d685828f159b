"""An approximate, bounded index of the prompt prefixes each worker has recently served.

The router has no tokenizer, so it indexes the prompt as the worker will receive it (rendered
chat text or token ids), cut into fixed chunks, each keyed by a hash chained over every chunk
before it as vLLM keys its KV blocks: one key names a whole prefix, and a flat map of keys per
worker is a radix tree whose edges are chunks, kept in least-recently-used order and bounded by
`max_chunks` or the worker's KV cache. Trade-off: characters, not tokens. A match has chunk
granularity (the last partial chunk of a shared prefix goes unseen), its length in tokens is an
estimate, and the index only guesses what a worker's cache holds (it is never told of the
worker's own evictions and forgets by its own LRU bound). In exchange a chunk costs one hash and
memory is bounded by workers x `max_chunks` keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from server.config.routing import DEFAULT_CHUNK_CHARS, DEFAULT_MAX_CHUNKS

_IDS_PER_CHAR = 4  # token-id prompts: chunk_chars // 4 ids per chunk (about as many tokens as text)
_TEXT_SEED, _IDS_SEED = 0x5EED, 0x1D5  # text and token-id prompts never share a key


def prefix_keys(prompt: str | Sequence[int], chunk_chars: int = DEFAULT_CHUNK_CHARS) -> tuple[int, ...]:
    """The chained key of every whole chunk of `prompt` (a trailing partial chunk has none)."""
    if isinstance(prompt, str):
        size, key, seq = chunk_chars, _TEXT_SEED, prompt
    else:
        size, key, seq = max(1, chunk_chars // _IDS_PER_CHAR), _IDS_SEED, tuple(prompt)
    keys = []
    for start in range(0, len(seq) - size + 1, size):
        key = hash((key, seq[start:start + size]))
        keys.append(key)
    return tuple(keys)


class PrefixIndex:
    """Per worker, the chunk keys of the prompts recently sent there.

    A prompt's chunks are `chunk_chars` characters, or a quarter as many token ids, each keyed
    k_i = hash(k_{i-1}, chunk_i); its match on a worker is the number of its leading keys the
    worker's map holds. Recording a prompt touches its keys deepest first, so a prefix's root is
    always at least as recent as its leaves and eviction trims leaves before roots: what is left
    of a prefix is still a prefix. A restarted worker holds nothing, and its map is dropped.
    Lives on the router's event loop (no locks)."""

    def __init__(self, chunk_chars: int = DEFAULT_CHUNK_CHARS, max_chunks: int = DEFAULT_MAX_CHUNKS):
        if chunk_chars < _IDS_PER_CHAR:
            raise ValueError(f"prefix chunk must be >= {_IDS_PER_CHAR} characters, got `{chunk_chars}`")
        if max_chunks < 1:
            raise ValueError(f"prefix index size must be >= 1 chunk per worker, got `{max_chunks}`")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._workers: dict[str, OrderedDict[int, None]] = {}
        self.evictions = 0

    def keys(self, prompt: str | Sequence[int]) -> tuple[int, ...]:
        return prefix_keys(prompt, self.chunk_chars)

    def chunk_units(self, prompt: str | Sequence[int]) -> int:
        """Characters (text) or token ids per chunk for this kind of prompt."""
        return self.chunk_chars if isinstance(prompt, str) else max(1, self.chunk_chars // _IDS_PER_CHAR)

    def match(self, keys: Sequence[int], worker_id: str) -> int:
        """How many leading chunks of the prompt with these keys the worker holds."""
        held = self._workers.get(worker_id)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def record(self, keys: Sequence[int], worker_id: str, limit: int | None = None) -> None:
        """The prompt with these keys was sent to the worker: it holds them now, most recent first.
        `limit`: what the worker's own cache holds, in chunks, when smaller than `max_chunks`."""
        held = self._workers.setdefault(worker_id, OrderedDict())
        for key in reversed(keys):  # deepest first: the root ends up the most recent
            held[key] = None
            held.move_to_end(key)
        # The root of the prefix just recorded is now the most recent; trim from the other end.
        bound = self.max_chunks if limit is None else max(1, min(limit, self.max_chunks))
        while len(held) > bound:
            held.popitem(last=False)
            self.evictions += 1

    def drop(self, worker_id: str) -> None:
        """The worker's cache is gone (a new process): forget what it held."""
        self._workers.pop(worker_id, None)

    def size(self, worker_id: str) -> int:
        return len(self._workers.get(worker_id, ()))
