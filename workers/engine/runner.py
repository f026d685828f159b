"""The model runner: one `SchedulerOutput` as one `model.step`, the only tensor work of a step.

Design: the scheduler's chunks become `SeqChunk`s over the paged KV cache, packed into one
`ForwardBatch` that asks for logits only where they are used (`num_logits`): the last row of
each chunk that samples, and every row of a prompt chunk scored for its logprobs. CPU decode rows
attend through the C++ kernel in place where the worker loaded it, else through a `DecodeMirror`
of the decoding sequences' K/V. A step of one-token chunks runs on the compiled decode step where
there is one (workers/engine/compiled.py). A step that also computes prompt chunks runs as one
eager forward where decode rows read the pool in place: the prompt's forward reads every weight
anyway and the decode rows ride along. Elsewhere (the torch path, GPUs) its decode rows still run
compiled and the prompt chunks eager in a second forward, the logits put back in chunk order.
A step holding a LoRA adapter's row runs eager whole: the compiled step does not trace the
adapters' hooks (workers/lora/apply.py).
Trade-off: the split walks one chunk list twice per step and reads the weights twice; the merged
forward gives up the compiled step for that step's decode rows."""

from __future__ import annotations

import torch

from workers.engine.compiled import CompiledDecode
from workers.kv.batch import ForwardBatch, SeqChunk
from workers.kv.mirror import DecodeMirror
from workers.lora.apply import lora_rows, step_lora


class ModelRunner:
    def __init__(self, model, kv, device: str | torch.device, mirror: bool = True,
                 compiled: CompiledDecode | None = None, in_place: bool = False):
        """`mirror=False` leaves the CPU decode mirror out (deterministic mode reads the pool);
        `compiled`: the decode step per bucket that one-token chunks run on (None: all eager);
        `in_place`: CPU decode rows attend through the C++ kernel (kernels_local/paged_attention/cpu.py:
        no mirror needed)."""
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.compiled, self.in_place = compiled, in_place
        # the mirror copies the first KV group's rows whole: not for a group that slides (bounded memory)
        self.windows = getattr(kv, "windows", (None,))
        on_cpu = self.device.type == "cpu" and compiled is None and not in_place
        self.mirror = DecodeMirror(kv) if on_cpu and mirror and self.windows[0] is None else None
        self.vocab_size: int | None = getattr(getattr(model, "config", None), "vocab_size", None)
        # rotaries that depend on the prompt's length (dynamic, LongRoPE: workers/model/rope.py)
        self.rope_threshold: int | None = getattr(model, "rope_threshold", None)

    def _forward(self, chunks, rows_of, preempted=()) -> torch.Tensor:
        """One eager `model.step` where chunk `i` projects its last `rows_of(i, chunk)` rows."""
        if self.mirror is not None:
            for seq in preempted:  # recomputed later: its mirrored row would be stale
                self.mirror.release(seq.uid)
        batch = ForwardBatch.build(self._items(chunks, rows_of), self.kv.block_size, self.device, self.mirror,
                                   self.windows, self.in_place)
        with lora_rows(self.model, step_lora(chunks, self.device)):
            return self.model.step(batch, self.kv)

    def _items(self, chunks, rows_of) -> list[tuple[SeqChunk, list[int]]]:
        """The `(SeqChunk, token ids)` pairs a `ForwardBatch` packs, chunk `i` projecting `rows_of(i, chunk)` rows."""
        rope = self.rope_threshold is not None
        return [(SeqChunk(c.start_pos, len(c.token_ids), c.block_table, rows_of(i, c), c.seq.uid,
                          c.seq.rope_len if rope else 0, c.seq.group_tables, c.seq.state_slot), c.token_ids)
                for i, c in enumerate(chunks)]

    def execute(self, out) -> torch.Tensor:
        """Logits [N, V] float32, one row per sampling chunk, in chunk order."""
        if self.compiled is not None:
            logits = self._execute_compiled(out.chunks)
            if logits is not None:
                return logits
        return self._forward(out.chunks, lambda i, c: int(c.samples), out.preempted)

    def _execute_compiled(self, chunks) -> torch.Tensor | None:
        """The step's one-token chunks through the compiled decode, any prompt chunks eager in
        a second forward; None when the compiled decode cannot take them."""
        one = [c.samples and len(c.token_ids) == 1 for c in chunks]
        decodes = [c for c, d in zip(chunks, one, strict=True) if d]
        if not decodes or not self.compiled.fits(decodes) or any(c.seq.lora is not None for c in chunks):
            return None
        if self.in_place and len(decodes) != len(chunks):  # a mixed step: one eager forward (module docstring)
            return None
        logits = self.compiled.run(decodes)  # [Nd, V]
        if len(decodes) == len(chunks):
            return logits
        rest = [c for c, d in zip(chunks, one, strict=True) if not d]
        eager = self._forward(rest, lambda i, c: int(c.samples))  # [Np, V]
        merged = torch.cat((logits, eager))
        # rows in chunk order: the k-th sampling decode is row k, the k-th sampling prompt chunk Nd + k
        order, d, p = [], 0, len(decodes)
        for c, is_decode in zip(chunks, one, strict=True):
            if is_decode:
                order.append(d)
                d += 1
            elif c.samples:
                order.append(p)
                p += 1
        if order == list(range(len(order))):  # decodes first (the scheduler's order)
            return merged
        return merged[torch.tensor(order, device=merged.device)]

    def execute_with_prompt_logits(self, out, scored: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`execute`, plus the logits at every row of the chunks `scored` (indices into
        `out.chunks`), from the same forward: ([N, V], [[len(chunk), V] per scored chunk])."""
        wanted = set(scored)
        logits = self._forward(out.chunks, scored_rows(wanted), out.preempted)
        return split_scored(out.chunks, wanted, logits)


def scored_rows(wanted: set[int]):
    """`rows_of` for a forward that projects every row of the chunks `wanted`, the last of the others that sample."""
    return lambda i, c: len(c.token_ids) if i in wanted else int(c.samples)


def split_scored(chunks, wanted: set[int], logits: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The sampling rows [N, V] and each scored chunk's rows, from a forward that projected `scored_rows(wanted)`."""
    last, spans, row = [], [], 0
    for i, c in enumerate(chunks):
        n = len(c.token_ids) if i in wanted else int(c.samples)
        if i in wanted:
            spans.append(logits[row : row + n])
        if c.samples:
            last.append(row + n - 1)
        row += n
    return logits[torch.tensor(last, dtype=torch.int64, device=logits.device)], spans
