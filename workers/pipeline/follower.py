"""A stage after the first: its layers over what the previous stage sends, until told to stop.

Design: the worker's mission runs as for any worker (workers/main.py: bind, capability, load
only this stage's layers, kernelize, fp8 for this device, its CPU paths, then its KV cache sized
for its own layers, the blocks agreed with the other stages: the fewest any of them holds); the
serve step is then this loop instead of an HTTP socket: tell the first stage what it runs
(`describe_stage`), then per step receive the chunks and hidden states, build the same
`ForwardBatch` for this device, run the layers and hand the result on (hidden states to the next
stage, logits from the last back to the first). A stop message is passed on before leaving.
Trade-off: any error ends the process; the first stage sees the broken link and the whole
replica restarts (server/fleet/supervisor.py), rather than a stage recovering alone."""

from __future__ import annotations

import logging
import os

import torch

from workers.kv.batch import ForwardBatch
from workers.pipeline.metrics import StageClock
from workers.pipeline.transport import StageLink

logger = logging.getLogger(__name__)


def describe_stage(rank: int, bound, loaded, kernels: dict, fp8: dict, kv) -> dict:
    """What `/workers` shows of one stage: its device, layers, kernels, fp8 and bytes."""
    model = loaded.model
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    start, end = model.stage
    return {"rank": rank, "pid": os.getpid(), "layers": [start, end], "device": bound.to_dict(),
            "dtype": str(loaded.dtype).removeprefix("torch."), "kernels": {k: v.to_dict() for k, v in kernels.items()},
            "fp8": fp8, "weights_bytes": weights, "kv_cache_bytes": kv.nbytes,
            "state_bytes": 0 if kv.states is None else kv.states.nbytes}  # its own linear layers' state only


def _received(link: StageLink, hidden_size: int, clock: StageClock):
    with clock.waiting():  # for the previous stage
        return link.recv_step(hidden_size)


def serve_stage(bound, loaded, kernels: dict, fp8: dict, link: StageLink, kv, in_place: bool,
                clock: StageClock | None = None) -> int:
    """Serve as stage `link.rank` over its KV cache `kv` until the first stage stops the pipeline;
    the steps served. `in_place`: decode rows attend through the CPU's C++ kernel, as the first
    stage's do; `clock`: counts this stage's steps and compute time (workers/pipeline/metrics.py)."""
    link.gather(describe_stage(link.rank, bound, loaded, kernels, fp8, kv))
    hidden_size, sending = loaded.config.hidden_size, []
    clock = clock or StageClock()
    with torch.inference_mode():
        while (message := _received(link, hidden_size, clock)) is not None:
            items, hidden = message
            with clock.measure():
                batch = ForwardBatch.build(items, kv.block_size, bound.torch_device, None, kv.windows, in_place)
                out = loaded.model.step(batch, kv, hidden)  # [T, H], or the last stage's logits [N, V]
            with clock.waiting():
                link.wait(sending)  # the previous micro-batch has left
            sending = link.send_logits(out) if link.last else link.send_step(items, out)
    link.wait(sending)
    clock.flush()
    steps = clock.steps
    if not link.last:
        link.send_stop()
    link.close()
    logger.info("pipeline stopped after %d steps", steps)
    return steps
