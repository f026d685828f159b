"""A CPU worker's prefill step, with each of its CPU paths against the torch forms, side by side.

    python benchmarks/prefill.py                       # 16 prompts of 128 tokens, the embedded model, 1 thread
    python benchmarks/prefill.py --prompts 8 --tokens 256 --threads 2 --repeats 12

Design: the worker's own serve step is built in this process as `python -m workers` builds it on a
CPU (load, kernelize for the CPU, the CPU projections, the engine; `--compile off`: a prefill step
runs eager anyway), and a step prefilling `--prompts` prompts of `--tokens` random tokens is timed on
a thread of its own, as the engine thread runs it (its own malloc arena). Each round runs every
configuration once, in turn, so the machine's drift falls on all of them alike:
  torch      the torch forms: RMSNorm, SiluAndMul and the rotary embedding in torch, every projection
             through the column panels (`LARGE_ROWS` out of reach);
  +rmsnorm, +activation, +rotary, +onednn   the torch forms with that one CPU path switched on (the
             C++ kernels of kernels_local/rmsnorm/cpu.py, kernels_local/activation/cpu.py and
             kernels_local/rotary/cpu.py; oneDNN's matmul from `LARGE_ROWS` bfloat16 rows);
  worker     all of them: what a CPU worker's step runs.
That comparison runs in a child process with glibc's freed memory kept as a worker keeps it
(workers/device/host_memory.py); a second child runs the worker's configuration alone with glibc's
defaults, which cannot be put back in one process once changed (and whose thresholds move with
what else the process allocates: the torch forms' temporaries would raise them). Prints the median
step time of each configuration and its ratio to `torch`, then the worker's step with and without
its allocator setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ("torch", "+rmsnorm", "+activation", "+rotary", "+onednn", "worker")
_LARGE_ROWS: list[int] = []  # the worker's own `cpu_projections.LARGE_ROWS`, kept at the first `configure`


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "workers" / "default_model", help="HF-layout checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    p.add_argument("--threads", type=int, default=1, help="torch threads (a CPU worker on 2 cores has 1)")
    p.add_argument("--repeats", type=int, default=8, help="rounds of every configuration")
    p.add_argument("--memory", choices=("keep", "default"), help=argparse.SUPPRESS)  # one child's allocator
    return p.parse_args(argv)


def build_engine(args):
    """The worker's engine for this process's CPU, as `run_worker` assembles it (no socket)."""
    from workers.contract import WorkerConfig

    config = WorkerConfig(socket=str(ROOT / ".prefill-bench.sock"), compile="off", threads=args.threads,
                          dtype=args.dtype, max_batch=max(args.prompts, 1),
                          max_num_batched_tokens=args.prompts * args.tokens, no_prefix_cache=True)
    return worker_engine(config, args.model)[0].engine


def worker_engine(config, model):
    """(`BuiltEngine`, loaded model) of a worker with `config` serving `model` on this process's
    device, as `run_worker` assembles them (no socket, no compile yet)."""
    import torch

    from workers.device.bind import bind_device, capability
    from workers.engine.build import build_engine, build_kv, context_length, decide_compile, install_cpu_paths
    from workers.kernelize.apply import kernelize_for_device
    from workers.model.loader import load_model
    from workers.quant.fp8_convention import choose_fp8, lock_convention

    torch.set_num_threads(config.threads)
    bound = bind_device(None)
    cap = capability()
    loaded = load_model(model, config.dtype, bound.torch_device, cap, None, device_type=bound.type)
    kernelize_for_device(loaded.model, bound)
    conv, _ = choose_fp8(bound.type, cap)
    lock_convention(conv)
    cpu = install_cpu_paths(loaded, bound, config.deterministic)
    decision = decide_compile(config, bound, cpu, loaded.model, pipeline=False)
    context = context_length(config, loaded)
    kv = build_kv(config, bound, loaded, context, decision.enabled)
    return build_engine(config, bound, loaded, kv, decision, cpu, context), loaded


def configure(name: str) -> None:
    """Switch the CPU paths for configuration `name` (see the module docstring)."""
    from kernels_local.activation import cpu as activation
    from kernels_local.cpp_build import CppKernel, CppState
    from kernels_local.rmsnorm import cpu as rmsnorm
    from kernels_local.rotary import cpu as cpu_rotary
    from workers.model import cpu_projections

    for key, stem in (("+rmsnorm", rmsnorm.KERNEL.stem), ("+activation", activation.KERNEL.stem),
                      ("+rotary", cpu_rotary.KERNEL.stem)):
        for kernel in CppKernel.named(stem):  # the kernel layers' copy too (`CppKernel.made` says why)
            kernel.reset()
            if name not in (key, "worker"):
                kernel._state = CppState(False, "off for this configuration")
    _LARGE_ROWS[:] = _LARGE_ROWS or [cpu_projections.LARGE_ROWS]
    cpu_projections.LARGE_ROWS = _LARGE_ROWS[0] if name in ("+onednn", "worker") else 1 << 62


def measure(args, configs: tuple[str, ...]) -> dict[str, list[float]]:
    """Each configuration's prefill step times (seconds), `args.repeats` rounds, on a thread of its own."""
    import torch

    from workers.sampling.params import SamplingParams

    engine = build_engine(args)
    params = SamplingParams.create(max_new_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    vocab = engine.runner.vocab_size
    times: dict[str, list[float]] = {c: [] for c in configs}

    def one_step() -> float:
        for _ in range(args.prompts):
            engine.submit(torch.randint(1, vocab, (args.tokens,), generator=g).tolist(), params)
        t0 = time.perf_counter()
        engine.step()
        took = time.perf_counter() - t0
        while engine.scheduler.has_unfinished():
            engine.step()
        return took

    def rounds() -> None:
        for c in configs:  # warm-up: each configuration's kernels built, oneDNN's shapes made
            configure(c)
            one_step()
        for _ in range(args.repeats):
            for c in configs:
                configure(c)
                times[c].append(one_step())

    thread = threading.Thread(target=rounds, name="engine")
    thread.start()
    thread.join()
    return times


def child(args) -> int:
    if args.memory == "keep":
        from workers.device.host_memory import keep_freed_memory

        keep_freed_memory()
    print(json.dumps(measure(args, CONFIGS if args.memory == "keep" else ("worker",))))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.memory:
        return child(args)
    runs = {}
    for memory in ("keep", "default"):
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--memory", memory]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"the {memory} run failed:\n{done.stderr[-3000:]}")
        runs[memory] = {c: statistics.median(ts) for c, ts in json.loads(done.stdout.splitlines()[-1]).items()}
    print(f"prefill step of {args.prompts} prompts x {args.tokens} tokens, {args.dtype}, {args.threads} thread(s); "
          f"median of {args.repeats} rounds")
    base = runs["keep"]["torch"]
    for c in CONFIGS:
        print(f"  {c:<12} {runs['keep'][c] * 1e3:7.1f} ms  {runs['keep'][c] / base:5.2f}x the torch forms")
    kept, default = runs["keep"]["worker"], runs["default"]["worker"]
    print(f"  the worker's step with glibc's defaults {default * 1e3:.1f} ms, with freed memory kept "
          f"{kept * 1e3:.1f} ms ({kept / default:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
