"""The model runner: one `SchedulerOutput` as one `model.step`, the only tensor work of a step.

Design: the scheduler's chunks become `SeqChunk`s over the paged KV cache, packed into one
`ForwardBatch`; the batch asks the model for logits only where they are used (`num_logits`):
the last row of each chunk that samples, and every row of a prompt chunk whose request asked
for its prompt's logprobs (`execute_with_prompt_logits`), all from the same forward. On the
CPU the runner keeps a `DecodeMirror` of the decoding sequences' K/V (`workers.kv.mirror`),
releasing the row of a sequence the scheduler preempts. The trade-off: one chunk list is
walked twice per step (to pack it, then to split the logits), a few microseconds.

Test-only fault injection: `$HETSERVE_TEST_PERTURB_LOGITS=<worker id>:<scale>` makes the runner
of that worker add a fixed pseudo-random vector (standard normal x scale, seed 0) to every
logits row it returns, a stand-in for a card that computes wrong, so that tests can check the
router's canary catches it. It is read only when a worker id is given, never set by hetserve
itself, and does nothing unless the id matches.
"""

from __future__ import annotations

import logging
import os

import torch

from workers.contract import ENV_TEST_PERTURB_LOGITS
from workers.kv.batch import ForwardBatch, SeqChunk
from workers.kv.mirror import DecodeMirror

logger = logging.getLogger(__name__)


def injected_perturbation(worker_id: str | None, vocab_size: int | None, device) -> torch.Tensor | None:
    """The logits offset `$HETSERVE_TEST_PERTURB_LOGITS` asks of worker `worker_id` (test-only), or None."""
    raw = os.environ.get(ENV_TEST_PERTURB_LOGITS, "")
    target, _, scale = raw.rpartition(":")
    if not raw or worker_id is None or vocab_size is None or target != worker_id:
        return None
    try:
        value = float(scale)
    except ValueError as e:
        raise ValueError(f"`${ENV_TEST_PERTURB_LOGITS}={raw}` is not `<worker id>:<scale>`") from e
    logger.warning("TEST-ONLY fault injection: logits perturbed by N(0, 1) x %g", value)
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(vocab_size, generator=gen) * value).to(device)


class ModelRunner:
    def __init__(self, model, kv, device: str | torch.device, worker_id: str | None = None, mirror: bool = True):
        """`mirror=False` leaves the CPU decode mirror out (deterministic mode reads the pool)."""
        self.model, self.kv, self.device = model, kv, torch.device(device)
        # the mirror copies the first KV group's rows whole: not for a group that slides (bounded memory)
        self.windows = getattr(kv, "windows", (None,))
        self.mirror = DecodeMirror(kv) if self.device.type == "cpu" and mirror and self.windows[0] is None else None
        self.vocab_size: int | None = getattr(getattr(model, "config", None), "vocab_size", None)
        self.perturb = injected_perturbation(worker_id, self.vocab_size, self.device)
        # rotaries that depend on the prompt's length (dynamic, LongRoPE: workers/model/rope.py)
        self.rope_threshold: int | None = getattr(model, "rope_threshold", None)

    def _forward(self, out, rows_of) -> torch.Tensor:
        """One `model.step` where chunk `i` projects its last `rows_of(i, chunk)` rows."""
        if self.mirror is not None:
            for seq in out.preempted:  # recomputed later: its mirrored row would be stale
                self.mirror.release(seq.uid)
        rope = self.rope_threshold is not None
        items = [(SeqChunk(c.start_pos, len(c.token_ids), c.block_table, rows_of(i, c), c.seq.uid,
                           c.seq.rope_len if rope else 0, c.seq.group_tables), c.token_ids)
                 for i, c in enumerate(out.chunks)]
        batch = ForwardBatch.build(items, self.kv.block_size, self.device, self.mirror, self.windows)
        logits = self.model.step(batch, self.kv)
        return logits if self.perturb is None else logits + self.perturb

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
