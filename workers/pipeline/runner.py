"""The first stage's runner: its layers here, the rest on the next stages, logits back.

Design: a `ModelRunner` whose one forward packs the step's chunks as every runner does, runs
this stage's layers (the embedding first), sends the chunks and hidden states to stage 1
(workers/pipeline/transport.py) and waits for the last stage's logits; the scheduler, the
sampler and the output processing above it do not know a pipeline is below. No CPU decode
mirror (the stages would each need the same rows) and no compiled step: a stage's step
crosses processes. The trade-off: one step is in flight at a time, so each stage waits while
the others compute; overlapping several micro-batches is the next step of this design.
"""

from __future__ import annotations

from workers.engine.runner import ModelRunner
from workers.kv.batch import ForwardBatch
from workers.pipeline.transport import StageLink


class PipelineRunner(ModelRunner):
    def __init__(self, model, kv, device, link: StageLink, worker_id: str | None = None):
        super().__init__(model, kv, device, worker_id=worker_id, mirror=False, compiled=None)
        self.link = link

    def _forward(self, chunks, rows_of, preempted=()):
        items = self._items(chunks, rows_of)
        batch = ForwardBatch.build(items, self.kv.block_size, self.device, None, self.windows)
        hidden = self.model.step(batch, self.kv)  # [T, H] after this stage's layers
        self.link.send_step(items, hidden)
        return self.link.recv_logits(batch.logits_index.shape[0], self.vocab_size)  # [N, V] from the last stage

    def stop(self) -> None:
        """Tell the next stages to finish (they pass it on) and leave the process group."""
        self.link.send_stop()
        self.link.close()
