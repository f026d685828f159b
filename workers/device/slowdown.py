"""A slower device, on purpose: `HETSERVE_SLOWDOWN`, for benchmarks and tests only.

Routing across unequal GPUs can only be measured with unequal workers, and simulated workers
on one CPU host are all as fast as each other. `HETSERVE_SLOWDOWN="gpu0=3,gpu2=1.5"` makes
each listed worker's forward passes take that many times as long (a bare number applies to
every worker): after each `model.step` the engine thread sleeps for (factor - 1) times the
CPU time the step used (the thread's own CPU time when torch computes on one thread, as
simulated workers sharing a host do, so that waiting for a core shared with the other
workers is not multiplied too; else the wall time), inside the engine step, so the worker's
step time, its throughput and its metrics all show a device that much slower, and the sleep
leaves the CPU to the others, as a slower GPU would. The router passes its environment on to the workers, so the variable
is set where `hetserve serve` starts. Trade-off: on a real GPU a step's launch returns before
the device finishes, so the factor would apply to the launch time only; the knob is meant for
simulated workers on a CPU.
"""

from __future__ import annotations

import functools
import logging
import os
import time

from workers.contract.slowdown import ENV_SLOWDOWN, slowdown_factor

logger = logging.getLogger(__name__)

def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def apply_slowdown(model, worker_id: str, environ=os.environ) -> float:
    """Wrap `model.step` so that it takes `factor` times as long; returns the factor (1.0: untouched)."""
    factor = slowdown_factor(environ.get(ENV_SLOWDOWN, ""), worker_id)
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
    logger.warning("%s: every forward pass of this worker takes %gx as long (benchmarks and tests only)",
                   ENV_SLOWDOWN, factor)
    return factor
