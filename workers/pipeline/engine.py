"""The first stage's engine: several batches in flight through the stages at once.

Design: an `Engine` whose step launches batches until `batches` are in flight (each from the
sequences no batch in flight holds, at most `--max-batch / batches` of them) and then lands the
oldest: its logits back from the last stage, sampled and applied as any step's. While stage 1
computes one batch this stage computes the next, so on decode every stage is busy. The scheduler
keeps the batches apart (`Scheduler.schedule(busy=...)`: a sequence in flight is neither
scheduled again nor preempted), and every stage takes the batches in launch order, so a block
freed by one batch and reused by the next is written in that order everywhere. Trade-off: each
batch is a fraction of `--max-batch` and decoding reads every weight once per batch, so overlap
wins only where the stages truly compute at once (docs/benchmarks.md, "Pipelines")."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from workers.engine.core import Engine
from workers.sampling.logprobs import prompt_chunks, record_prompt


@dataclass
class _Flight:
    out: object  # SchedulerOutput
    seqs: list
    masks: object
    scored: list[int]
    launched: tuple
    t0: float


class PipelineEngine(Engine):
    def __init__(self, runner, scheduler, tokenizer, *, batches: int = 1, **kw):
        super().__init__(runner, scheduler, tokenizer, **kw)
        self.batches = max(1, batches)
        self.per_batch = -(-scheduler.config.max_sequences // self.batches) if self.batches > 1 else None
        self._flight: deque[_Flight] = deque()

    def _idle(self) -> bool:
        return not self._flight and super()._idle()

    def _wait_for_work(self):
        with self.runner.clock.waiting():  # idle time is no work of this stage's (workers/pipeline/metrics.py)
            return super()._wait_for_work()

    def _step(self) -> int:
        self._drain_inbox()
        if self._stopping:  # what is on its way lands first: no stage is left with an unread send
            while self._flight:
                self._land()
            return 0
        while len(self._flight) < self.batches:
            busy = frozenset(id(c.seq) for f in self._flight for c in f.out.chunks)
            out = self.scheduler.schedule(busy, self.per_batch)
            if out.is_empty:
                break
            t0 = time.perf_counter()
            seqs = [c.seq for c in out.chunks if c.samples]
            scored = prompt_chunks(out.chunks)
            masks = self._start_masks(seqs)
            self._flight.append(_Flight(out, seqs, masks, scored, self.runner.launch(out, scored), t0))
        return self._land() if self._flight else 0

    def _land(self) -> int:
        f = self._flight.popleft()
        logits, prompt_logits = self.runner.land(f.launched, f.out, f.scored)
        for i, rows in zip(f.scored, prompt_logits, strict=True):
            record_prompt(f.out.chunks[i], rows)
        if self._stopping:
            return 0
        return self._update(f.out, f.seqs, f.masks, logits, f.t0)
