"""The child process that compiles a worker's decode step into the on-disk caches, then exits.

    python -m workers.compile_child SPEC.json

Design: the worker (workers/engine/warm_caches.py) writes SPEC (its `WorkerConfig`, its KV pool's
groups, block size, buckets, whether rows attend in place) and reads one JSON line per bucket
compiled on stdout. The child builds everything itself, in the worker's order: bind, capability,
load, kernelize, fp8, the CPU paths (the C++ kernels the worker built are in the shared extension
cache by then), the KV pool of the same shapes, then `CompiledDecode.warm()` under the worker's
environment (the same Inductor cache directory), at low priority and with no engine beside it. It
exits when its parent does. Trade-off: the mission's steps are repeated here rather than shared
with workers/main.py, whose steps also report status and serve; the graph the worker compiles
afterwards is only a cache hit if both build the same model, which tests/test_compile_child.py
checks."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from workers.contract import DEFAULT_MODEL_DIR, WorkerConfig, use_triton_cache
from workers.engine.warm_caches import first_use
from workers.model.row_buckets import cap_native_caches

logger = logging.getLogger(__name__)

NICE = 10  # below the serving worker: this process takes the cores it leaves
PARENT_POLL_S = 0.5


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m workers.compile_child SPEC.json", file=sys.stderr)
        return 2
    cap_native_caches()  # before torch loads, as the worker does
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [compile child] %(name)s: %(message)s")
    os.nice(NICE)
    _exit_with_parent(os.getppid())
    spec = json.loads(Path(argv[0]).read_text())
    compiled = build_decode(spec)
    first_use("inductor")  # into the caches too: the worker's own first use is then a load
    compiled.warm(on_bucket=lambda: print(json.dumps({"done": compiled.done}), flush=True))
    return 0


def build_decode(spec: dict):
    """The worker's model and KV pool built again from `spec`, and its `CompiledDecode` (not warmed)."""
    from workers.device.bind import bind_device, capability
    from workers.engine.build import install_cpu_paths
    from workers.engine.compiled import CompiledDecode
    from workers.kernelize.apply import kernelize_for_device
    from workers.kv.groups import KVGroup
    from workers.kv.pool import KVPool
    from workers.main import apply_fp8
    from workers.model.loader import load_model

    config = WorkerConfig.from_dict(spec["config"])
    bound = bind_device(config.simulate, config.device_index, config.device_uuid)
    use_triton_cache(bound.arch_name)
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    cap = capability()
    loaded = load_model(config.model or DEFAULT_MODEL_DIR, config.dtype, bound.torch_device, cap, None,
                        device_type=bound.type)
    kernelize_for_device(loaded.model, bound)
    apply_fp8(config, bound, cap, loaded)
    install_cpu_paths(loaded, bound, False)
    groups = tuple(KVGroup(**{**g, "layers": tuple(g["layers"])}) for g in spec["groups"])
    kv = KVPool.for_config(loaded.config, groups[0].num_blocks, spec["block_size"], loaded.dtype, bound.torch_device,
                           groups, state_slots=spec.get("state_slots") or config.max_batch)
    return CompiledDecode(loaded.model, kv, bound.torch_device, tuple(spec["buckets"]), "inductor",
                          in_place=spec["in_place"])


def _exit_with_parent(parent: int) -> None:
    """Exit as soon as the worker that started this child is gone (its compile has no one to serve)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="hetserve-parent-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
