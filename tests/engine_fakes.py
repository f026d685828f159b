"""Fakes shared by the engine tests: a model whose logits depend only on a sequence's own
tokens, as read back from a fake paged KV cache, and a tokenizer from the small checkpoint
helper. No weights, no device."""

from __future__ import annotations

import threading
import time
import zlib

import torch
from tokenizers import Tokenizer

from tests.checkpoints import tokenizer_json

VOCAB = 512
EOS_ID = 1


def tokenizer(vocab: int = VOCAB) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json(vocab))


def history_logits(tokens: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """Deterministic logits [V] for a token history: random-looking, a clear argmax, no EOS."""
    seed = zlib.crc32(bytes(str(tokens), "ascii"))
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    row[EOS_ID] = -1e4  # the fake never ends by itself unless told to
    return row


class FakeRunner:
    """Stands in for `ModelRunner`. Its "KV cache" is a dict slot -> token id: each chunk writes
    its tokens at `block * block_size + offset` through its block table, and a sampling chunk
    reads the whole sequence back through the same table, so a wrong block table, a prefix
    hit on the wrong block or a shared block overwritten shows up as different logits (and
    fails the read-back assertion). One row per sampling chunk, from that history only.
    Records every step's chunks so tests can check what was batched."""

    def __init__(self, vocab: int = VOCAB, eos_after: dict[str, int] | None = None, script=None, delay=0.0,
                 block_size: int = 16):
        self.vocab = vocab
        self.block_size = block_size
        self.delay = delay  # seconds per step, to make a step observable from another thread
        self.eos_after = eos_after or {}  # request_id -> emit EOS once this many tokens are out
        self.script: dict[str, list[int]] = script or {}  # request_id -> tokens to emit, in order
        self.steps: list[list[tuple[str, int, int, bool]]] = []  # (request_id, start_pos, n, samples)
        self.threads: list[str] = []  # the thread each step ran on
        self.cache: dict[int, int] = {}  # slot -> token id whose K/V it holds

    def slot(self, table, pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out):
        if self.delay:
            time.sleep(self.delay)
        self.steps.append([(c.seq.request_id, c.start_pos, len(c.token_ids), c.samples) for c in out.chunks])
        self.threads.append(threading.current_thread().name)
        for c in out.chunks:  # 1. write every chunk's tokens (as the model writes K/V first)
            assert c.start_pos == c.seq.num_computed  # the cache holds exactly the tokens before it
            for i, tok in enumerate(c.token_ids):
                self.cache[self.slot(c.block_table, c.start_pos + i)] = tok
        rows = []
        for c in out.chunks:  # 2. attend: read the sequence back through its block table
            if not c.samples:
                continue
            seq = c.seq
            history = [self.cache.get(self.slot(c.block_table, p)) for p in range(c.start_pos + len(c.token_ids))]
            assert history == seq.token_ids(), f"{seq.request_id}: the cache holds {history}"
            row = history_logits(history, self.vocab)
            if len(seq.output_ids) + 1 >= self.eos_after.get(seq.request_id, 1 << 30):
                row[EOS_ID] = 1e4
            script = self.script.get(seq.request_id)
            if script and len(seq.output_ids) < len(script):
                row[script[len(seq.output_ids)]] = 1e4
            rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, self.vocab)  # [N, V]

    def execute_with_prompt_logits(self, out, scored: list[int]):
        """`execute`, plus each scored chunk's rows: row j predicts the token after position
        start_pos + j, from the history up to it (what the real runner returns)."""
        last = self.execute(out)
        rows = []
        for i in scored:
            c = out.chunks[i]
            history = c.seq.prompt_ids + c.seq.output_ids
            rows.append(torch.stack([history_logits(history[: c.start_pos + j + 1], self.vocab)
                                     for j in range(len(c.token_ids))]))
        return last, rows
