"""`--compile auto|on|off`: whether workers run their decode step compiled per batch bucket.

The router only validates and forwards the mode; each worker decides for its own device
(workers/engine/compiled.py `decide`: Inductor on a CPU worker, CUDA/HIP graphs on a real
GPU, eager for a simulated GPU under `auto`) and reports the decision, its reason and its
buckets in `/capability` `compile`. Under `auto` the worker's configuration gets
`$HETSERVE_COMPILE` where the router runs, else `auto` (server/fleet/spec.py `worker_config`); the
modes are the contract's (`COMPILE_MODES`), so the two processes accept the same ones.
"""

from __future__ import annotations

import argparse

from server.errors import UsageError
from workers.contract import COMPILE_MODES

AUTO = "auto"


def add_compile_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("compile", "the workers' decode step")
    g.add_argument("--compile", default=None, metavar="|".join(COMPILE_MODES),
                   help="run each worker's decode step compiled per batch bucket (Inductor on CPU workers, "
                        "CUDA/HIP graphs on GPUs; compiled at start): auto (default: real GPUs and CPU workers, "
                        "not simulated GPUs), on, off")


def compile_from_args(args) -> str:
    """The `--compile` mode (`UsageError` names a bad one); `auto` when not given."""
    value = getattr(args, "compile", None)
    if value is None:
        return AUTO
    if value not in COMPILE_MODES:
        raise UsageError(f"`--compile {value}` is not a mode. Accepted: {', '.join(COMPILE_MODES)}")
    return value
