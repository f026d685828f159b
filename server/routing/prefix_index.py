"""An approximate, bounded index of the prompt prefixes each worker has recently served.

The router has no tokenizer (it never imports torch or the model's files), so it indexes
what it has: the prompt as the worker will receive it, rendered chat text or token ids. The
prompt is cut into fixed chunks (`chunk_chars` characters, or a quarter as many token ids)
and each chunk gets a key hashed over every chunk before it (k_i = hash(k_{i-1}, chunk_i)),
as vLLM keys its KV blocks, so one key names a whole prefix and a flat map of keys is a
radix tree whose edges are chunks. Each worker has its own map, bounded (`max_chunks`) and
kept in least-recently-used order. A prompt's match on a worker is the number of its leading
keys that the worker's map holds. Recording a prompt touches its keys deepest first, so a
prefix's root is always at least as recent as its leaves and eviction trims leaves before
roots: what is left of a prefix is still a prefix. A worker's map holds at most `max_chunks`
keys, or fewer when its KV cache is smaller (what it could hold, in chunks), since it evicts
what does not fit; a restarted worker holds nothing, and its map is dropped.

Trade-off: characters, not tokens. A match has chunk granularity (the last partial chunk of
a shared prefix goes unseen), its length in tokens is an estimate (characters over the
learned characters per token), and the index only guesses what a worker's cache holds: it
is never told of the worker's own evictions and forgets by its own LRU bound, sized like the
worker's cache. In exchange the router needs no tokenizer, a chunk costs
one hash, and memory is bounded by workers x `max_chunks` keys (about 100 bytes each).
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
    """Per worker, the chunk keys of the prompts recently sent there (see the module docstring).

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
