"""A real worker that computes wrong, for the canary's end-to-end test (tests/test_e2e_canary.py).

Started by the router in place of `python -m workers` (`HETSERVE_WORKER_CMD="python
tests/perturbed_worker.py"`): the worker whose id `$PERTURB_LOGITS=<worker id>:<scale>` names adds
a fixed pseudo-random vector (standard normal x scale, seed 0) to every logits row its model runner
returns, a stand-in for a card that computes wrong; every other worker runs unchanged. Then it is
`workers.main.main`, as any worker. The hook lives here, in the tests: nothing in `workers/` reads it.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from workers.engine.runner import ModelRunner  # the router puts this checkout on the worker's PYTHONPATH
from workers.main import main, parse_args

ENV_PERTURB_LOGITS = "PERTURB_LOGITS"
logger = logging.getLogger("tests.perturbed_worker")


def perturb(scale: float) -> None:
    """Every `ModelRunner` of this process adds the same N(0, 1) x `scale` vector to its logits."""
    execute, with_prompt = ModelRunner.execute, ModelRunner.execute_with_prompt_logits
    offsets: dict = {}

    def offset(runner: ModelRunner) -> torch.Tensor:
        key = (runner.vocab_size, runner.device)
        if key not in offsets:
            gen = torch.Generator().manual_seed(0)
            offsets[key] = (torch.randn(runner.vocab_size, generator=gen) * scale).to(runner.device)
        return offsets[key]

    def perturbed_execute(self, out):
        return execute(self, out) + offset(self)

    def perturbed_with_prompt(self, out, scored):
        logits, spans = with_prompt(self, out, scored)
        return logits + offset(self), [span + offset(self) for span in spans]

    ModelRunner.execute, ModelRunner.execute_with_prompt_logits = perturbed_execute, perturbed_with_prompt
    logger.warning("TEST-ONLY fault injection: logits perturbed by N(0, 1) x %g", scale)


if __name__ == "__main__":
    target, _, scale = os.environ.get(ENV_PERTURB_LOGITS, "").rpartition(":")
    if target and parse_args(sys.argv[1:]).worker_id == target:
        perturb(float(scale))
    sys.exit(main())
