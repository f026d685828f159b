"""A slower simulated device, on purpose: benchmarks and tests only.

Routing across unequal GPUs can only be measured with unequal workers. The router reads
`$HETSERVE_SLOWDOWN` once (workers/contract/slowdown.py) and gives each simulated device's worker
its two factors in its `WorkerConfig`: one for prefill tokens (compute-bound on a real card), one
for decode rows (bandwidth-bound). Design: after each `model.step` the engine thread sleeps for
(factor - 1) times the CPU time the step used (the thread's own CPU time when torch computes on
one thread, so waiting for a core shared with other workers is not multiplied too; else the wall
time), so the worker's step time, throughput and metrics show a device that much slower, and the
sleep leaves the CPU to the others, as a slower GPU would. A step mixing both phases takes the
factors weighted by its tokens (a prefill chunk's tokens against its decode rows). Trade-off:
only a simulated device is slowed (workers/main.py refuses the factors elsewhere): on a real GPU a
step's launch returns before the device finishes, so a factor would apply to the launch time only."""

from __future__ import annotations

import functools
import logging
import time

from workers.contract.slowdown import NONE, Slowdown

logger = logging.getLogger(__name__)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def step_factor(slowdown: Slowdown, batch) -> float:
    """The factor for one step over `batch` (a `ForwardBatch`: its `prefills` and `decode` rows):
    the phases' factors weighted by their tokens; the decode factor for anything else."""
    prefills, decode = getattr(batch, "prefills", None), getattr(batch, "decode", None)
    if prefills is None:
        return slowdown.decode
    p = sum(span.num_tokens for span in prefills)
    d = decode.num if decode is not None else 0
    return (p * slowdown.prefill + d * slowdown.decode) / (p + d) if p + d else slowdown.decode


def apply_slowdown(model, slowdown: Slowdown) -> Slowdown:
    """Wrap `model.step` so that it takes its step's factor times as long; returns the factors
    applied (`NONE`: untouched)."""
    if not slowdown.slowed:
        return NONE
    step = model.step
    clock = time.thread_time if _torch_threads() == 1 else time.perf_counter

    @functools.wraps(step)
    def slowed(*args, **kwargs):
        started = clock()
        out = step(*args, **kwargs)
        factor = step_factor(slowdown, args[0] if args else kwargs.get("batch"))
        time.sleep((factor - 1.0) * (clock() - started))
        return out

    model.step = slowed
    logger.warning("slowdown: this simulated device's forward passes take %s as long (%s; benchmarks and tests "
                   "only)", slowdown.describe(), slowdown.why or "its configuration")
    return slowdown
