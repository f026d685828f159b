"""The first stage's runner: its layers here, the rest on the next stages, logits back.

Design: a `ModelRunner` whose forward packs the step's chunks as every runner does, runs this
stage's layers (the embedding first), sends the chunks and hidden states to stage 1
(workers/pipeline/transport.py) and waits for the last stage's logits; the scheduler, sampler and
output processing above it do not know a pipeline is below. No CPU decode mirror and no compiled
step: a stage's step crosses processes. `--pipeline-microbatches N` cuts a step's chunks into N
runs of about equal tokens (`micro_batches`), each sent on as soon as computed; cutting is exact (a
chunk reads only its own sequence's blocks). Trade-off: decoding is bound by reading the weights
and every micro-batch reads them again, so it is off by default (docs/benchmarks.md,
"Pipelines"); keeping the stages busy is the engine's several batches in flight instead."""

from __future__ import annotations

import torch

from workers.engine.runner import ModelRunner, scored_rows, split_scored
from workers.kv.batch import ForwardBatch
from workers.pipeline.metrics import StageClock
from workers.pipeline.transport import StageLink


class PipelineRunner(ModelRunner):
    def __init__(self, model, kv, device, link: StageLink, micro: int | None = None, clock: StageClock | None = None,
                 in_place: bool = False):
        super().__init__(model, kv, device, mirror=False, compiled=None, in_place=in_place)
        self.link = link
        self.micro = micro or 1  # micro-batches per step (`--pipeline-microbatches`; see the module docstring)
        self.clock = clock or StageClock()  # this stage's own compute (workers/pipeline/metrics.py)

    def _forward(self, chunks, rows_of, preempted=()):
        return self._receive(*self._send(self._items(chunks, rows_of)))

    def launch(self, out, scored: list[int]):
        """Send one step on its way (this stage's layers computed, the rest on the next stages);
        `land` gets its logits. Steps land in the order they were launched."""
        wanted = set(scored)
        return self._send(self._items(out.chunks, scored_rows(wanted) if wanted else lambda i, c: int(c.samples)))

    def land(self, launched, out, scored: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A launched step's sampling logits [N, V] and its scored chunks' rows (`execute_with_prompt_logits`)."""
        logits = self._receive(*launched)
        return split_scored(out.chunks, set(scored), logits) if scored else (logits, [])

    def _send(self, items) -> tuple[list, list[int]]:
        sends, rows = [], []
        for part in micro_batches(items, self.micro):  # each on its way while this stage computes the next
            with self.clock.measure():
                batch = ForwardBatch.build(part, self.kv.block_size, self.device, None, self.windows, self.in_place)
                hidden = self.model.step(batch, self.kv)  # [T_m, H] after this stage's layers
            sends += self.link.send_step(part, hidden)
            rows.append(batch.logits_index.shape[0])
        return sends, rows

    def _receive(self, sends: list, rows: list[int]) -> torch.Tensor:
        with self.clock.waiting():  # for the other stages
            logits = [self.link.recv_logits(n, self.vocab_size) for n in rows]  # [N_m, V] each, from the last stage
            self.link.wait(sends)
        return logits[0] if len(logits) == 1 else torch.cat(logits)  # [N, V] in chunk order

    def stop(self) -> None:
        """Tell the next stages to finish (they pass it on) and leave the process group."""
        self.link.send_stop()
        self.link.close()


def micro_batches(items: list, parts: int) -> list[list]:
    """`items` (a step's chunks, in order) cut into at most `parts` runs of about equal tokens, none empty."""
    parts = max(1, min(parts, len(items)))
    total = sum(chunk.num_tokens for chunk, _ in items)
    out: list[list] = []
    run: list = []
    done = 0
    for i, item in enumerate(items):
        n, target = item[0].num_tokens, total * (len(out) + 1) / parts
        must = len(items) - i == parts - len(out) - 1  # one item left per run still to make
        if run and len(out) < parts - 1 and (must or done + n - target > target - done):
            out.append(run)  # this item would overshoot the run's share more than it leaves short
            run = []
        run.append(item)
        done += n
    return [*out, run]
