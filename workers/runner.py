"""The model runner: one `SchedulerOutput` as one `model.step`, the only tensor work of a step.

Design: the scheduler's chunks become `SeqChunk`s over the paged KV cache, packed into one
`ForwardBatch`; the batch asks the model for logits only where they are used (`num_logits`):
the last row of each chunk that samples, and every row of a prompt chunk whose request asked
for its prompt's logprobs (`execute_with_prompt_logits`), all from the same forward. On the
CPU the runner keeps a `DecodeMirror` of the decoding sequences' K/V (`workers.kv.mirror`),
releasing the row of a sequence the scheduler preempts. The trade-off: one chunk list is
walked twice per step (to pack it, then to split the logits), a few microseconds.
"""

from __future__ import annotations

import torch

from workers.kv import DecodeMirror, ForwardBatch, SeqChunk


class ModelRunner:
    def __init__(self, model, kv, device: str | torch.device):
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.mirror = DecodeMirror(kv) if self.device.type == "cpu" else None
        self.vocab_size: int | None = getattr(getattr(model, "config", None), "vocab_size", None)

    def _forward(self, out, rows_of) -> torch.Tensor:
        """One `model.step` where chunk `i` projects its last `rows_of(i, chunk)` rows."""
        if self.mirror is not None:
            for seq in out.preempted:  # recomputed later: its mirrored row would be stale
                self.mirror.release(seq.uid)
        items = [(SeqChunk(c.start_pos, len(c.token_ids), c.block_table, rows_of(i, c), c.seq.uid), c.token_ids)
                 for i, c in enumerate(out.chunks)]
        return self.model.step(ForwardBatch.build(items, self.kv.block_size, self.device, self.mirror), self.kv)

    def execute(self, out) -> torch.Tensor:
        """Logits [N, V] float32, one row per sampling chunk, in chunk order."""
        return self._forward(out, lambda i, c: int(c.samples))

    def execute_with_prompt_logits(self, out, scored: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`execute`, plus the logits at every row of the chunks `scored` (indices into
        `out.chunks`), from the same forward: ([N, V], [[len(chunk), V] per scored chunk])."""
        wanted = set(scored)
        logits = self._forward(out, lambda i, c: len(c.token_ids) if i in wanted else int(c.samples))
        last, spans, row = [], [], 0
        for i, c in enumerate(out.chunks):
            n = len(c.token_ids) if i in wanted else int(c.samples)
            if i in wanted:
                spans.append(logits[row : row + n])
            if c.samples:
                last.append(row + n - 1)
            row += n
        return logits[torch.tensor(last, dtype=torch.int64, device=logits.device)], spans
