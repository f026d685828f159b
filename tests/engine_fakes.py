"""Fakes shared by the engine tests: a model whose logits depend only on a sequence's own
tokens, and a tokenizer from the small checkpoint helper. No weights, no device."""

from __future__ import annotations

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
    """Stands in for `ModelRunner`: one row per chunk, from that sequence's history only.
    Records every step's chunks so tests can check what was batched."""

    def __init__(self, vocab: int = VOCAB, eos_after: dict[str, int] | None = None, script=None, delay=0.0):
        self.vocab = vocab
        self.delay = delay  # seconds per step, to make a step observable from another thread
        self.eos_after = eos_after or {}  # request_id -> emit EOS once this many tokens are out
        self.script: dict[str, list[int]] = script or {}  # request_id -> tokens to emit, in order
        self.steps: list[list[tuple[str, int, int, int]]] = []  # (request_id, slot, start_pos, n)

    def execute(self, out):
        if self.delay:
            time.sleep(self.delay)
        self.steps.append([(c.seq.request_id, c.slot, c.start_pos, len(c.token_ids)) for c in out.chunks])
        rows = []
        for c in out.chunks:
            seq = c.seq
            # The cache must hold exactly the tokens before this chunk.
            assert c.start_pos == seq.num_computed
            row = history_logits(seq.prompt_ids + seq.output_ids, self.vocab)
            if len(seq.output_ids) + 1 >= self.eos_after.get(seq.request_id, 1 << 30):
                row[EOS_ID] = 1e4
            script = self.script.get(seq.request_id)
            if script and len(seq.output_ids) < len(script):
                row[script[len(seq.output_ids)]] = 1e4
            rows.append(row)
        return torch.stack(rows)  # [N, V]

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
