"""The C++ kernels every real CPU-side worker loads, built in the background once the suite is collected.

A fresh host (CI's clean clone) has none of them in torch's extension cache, and the first real
worker of the run builds them itself: a simulated GPU's worker one after another before ready,
minutes on two cores, inside whichever fixture comes first. Started at collection (tests/conftest.py),
one child builds them side by side (`workers/engine/build.py` `build_cpu_kernels`, as a CPU
worker does) while the unit tests at the front of the run leave a core idle; a worker that
starts meanwhile waits on the same build's lock (kernels_local/cpp_build.py) instead of
building again, and finds them built later. Trade-off: a core for about a minute at the start of a
run that may, where they were built already, only load them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FINISH_TIMEOUT_S = 600
CHILD = """
import torch
import kernels_local.activation.cpu, kernels_local.rmsnorm.cpu, kernels_local.rotary.cpu, kernels_local.sampling.cpu
import kernels_local.gguf_linear.cpu  # a GGUF file's CPU worker builds it at load, before ready
from workers.engine.build import build_cpu_kernels
build_cpu_kernels(torch.bfloat16, False)
"""
_child: subprocess.Popen | None = None


def start_kernel_build() -> None:
    """Start the child now (its output discarded: a failed build is each worker's own to report)."""
    global _child
    if _child is None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        _child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)


def stop_background() -> None:
    """At the session's end: let a build still running finish (one killed mid-build leaves its
    directory for the next start to clear), then reap it."""
    global _child
    child, _child = _child, None
    if child is None:
        return
    try:
        child.wait(timeout=FINISH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
