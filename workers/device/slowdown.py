"""A slower simulated device, on purpose: benchmarks and tests only.

Routing across unequal GPUs can only be measured with unequal workers. The router reads
`$HETSERVE_SLOWDOWN` once (workers/contract/slowdown.py) and gives each simulated device's worker
its factor in its `WorkerConfig`. Design: after each `model.step` the engine thread sleeps for
(factor - 1) times the CPU time the step used (the thread's own CPU time when torch computes on
one thread, so waiting for a core shared with other workers is not multiplied too; else the wall
time), so the worker's step time, throughput and metrics show a device that much slower, and the
sleep leaves the CPU to the others, as a slower GPU would. Trade-off: only a simulated device is
slowed (workers/main.py refuses the factor elsewhere): on a real GPU a step's launch returns
before the device finishes, so the factor would apply to the launch time only."""

from __future__ import annotations

import functools
import logging
import time

logger = logging.getLogger(__name__)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def apply_slowdown(model, factor: float) -> float:
    """Wrap `model.step` so that it takes `factor` times as long; returns the factor (1.0: untouched)."""
    if factor == 1.0:
        return factor
    step = model.step
    clock = time.thread_time if _torch_threads() == 1 else time.perf_counter

    @functools.wraps(step)
    def slowed(*args, **kwargs):
        started = clock()
        out = step(*args, **kwargs)
        time.sleep((factor - 1.0) * (clock() - started))
        return out

    model.step = slowed
    logger.warning("slowdown: every forward pass of this simulated device takes %gx as long (benchmarks and tests "
                   "only)", factor)
    return factor
