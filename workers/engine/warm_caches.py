"""The decode step's Inductor compile in a child process, which fills the caches the worker loads from.

Design: Inductor compiling one bucket is a long stretch of Python (Dynamo, AOT autograd, the
lowering) and of C++ compiler; in the worker that shares the interpreter with the serving, and a
bucket's first call holds the engine's steps (`Engine.steps_held`: the model's layers are not safe
on two threads), so a step waited out each bucket's whole compile. Here a child process
(`python -m workers.compile_child SPEC`, started at low priority) builds the same model from the
worker's configuration and the same KV pool from its groups' shapes, compiles every bucket into
the worker's on-disk caches (`TORCHINDUCTOR_CACHE_DIR`: the AOT autograd and FX graph caches, and
the compiled C++), and exits. The worker then compiles each bucket itself, as before, and finds
its graph in those caches: a Dynamo trace and a load instead of a compile. Nothing crosses but a
JSON spec and files; the child rebuilds everything from the configuration.
Trade-off: the child holds a second copy of the weights and of the KV pool (a CPU worker's is at
most 512 MiB by default) while it runs, a warm start runs it too (it then finds every bucket in
the caches), and a graph it does not reproduce (a cache miss: say a LoRA hook on the worker's
model) is compiled in the worker as before, correct but holding the steps as long as before; a
child that fails costs only its time."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.contract import ENV_TRITON_CACHE_DIR, WorkerConfig

logger = logging.getLogger(__name__)

ENV_INDUCTOR_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"
CHILD_MODULE = "workers.compile_child"
TAIL_CHARS = 1500  # of a failed child's log, in the reason


def use_inductor_cache(env: dict | None = None) -> Path | None:
    """Point Inductor's on-disk cache beside this architecture's Triton cache
    (`<root>/<arch>` -> `<root>/<arch>-inductor`); None (and nothing set) without one."""
    env = os.environ if env is None else env
    triton = env.get(ENV_TRITON_CACHE_DIR)
    if not triton:
        return None
    path = Path(triton).with_name(Path(triton).name + "-inductor")
    env[ENV_INDUCTOR_CACHE_DIR] = str(path)
    return path


@dataclass(frozen=True)
class ChildCompile:
    """What the child needs to build the worker's decode step again: the worker's configuration, its
    KV pool's shape (each group as `workers.kv.groups.KVGroup`, the scratch blocks included) and the
    buckets. `in_place` is given when the child starts (the C++ kernels may have built behind)."""

    config: WorkerConfig
    groups: tuple
    block_size: int
    buckets: tuple[int, ...]
    state_slots: int = 0  # the linear layers' state pool's slots, running and spare (0: none)

    def spec(self, in_place: bool) -> dict:
        return {"config": self.config.to_dict(), "groups": [asdict(g) for g in self.groups],
                "block_size": self.block_size, "buckets": list(self.buckets), "in_place": in_place,
                "state_slots": self.state_slots}


def fill_caches(child: ChildCompile, in_place: bool, on_bucket: Callable[[int], None] = lambda done: None,
                command: tuple[str, ...] = (sys.executable, "-m", CHILD_MODULE)) -> str | None:
    """Run the child to its end; None when it compiled every bucket into the caches, else why not
    (the worker then compiles in-process, as without a child). `on_bucket(done)` after each bucket
    the child compiled; `command` runs the child (tests give a stand-in)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hetserve-compile-") as tmp:
        spec, log = Path(tmp) / "spec.json", Path(tmp) / "child.log"
        spec.write_text(json.dumps(child.spec(in_place)))
        try:
            with log.open("w") as err:
                proc = subprocess.Popen([*command, str(spec)], stdout=subprocess.PIPE, stderr=err, text=True)
                for line in proc.stdout:  # one JSON line per bucket compiled: {"done": n}
                    try:
                        on_bucket(int(json.loads(line)["done"]))
                    except (ValueError, KeyError, TypeError):
                        pass
                code = proc.wait()
        except OSError as e:
            return f"the compile child did not start ({e})"
        if code != 0:
            tail = log.read_text(errors="replace")[-TAIL_CHARS:].strip()
            return f"the compile child exited {code}: {tail or 'no output'}"
    logger.info("decode step: a child process compiled buckets %s into the Inductor cache in %.0f s",
                list(child.buckets), time.monotonic() - started)
    return None


def cache_misses() -> int:
    """Graphs Inductor compiled (or could not cache) so far in this process, not loaded from its caches."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"]


def first_use(backend: str) -> None:
    """Compile and run a one-op function with `backend`: the compiler's imports and set-up (Dynamo,
    AOT autograd, Inductor's code cache and C++ loader) happen here rather
    than inside the first bucket, whose compile holds the engine's steps."""
    import torch

    torch.compile(lambda x: x * 2 + 1, backend=backend, dynamic=False, fullgraph=True)(torch.ones(8))
