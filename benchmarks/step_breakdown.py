"""Where one decode step's time goes, per layer kind, beside the bound the weights' bytes set.

    .venv/bin/python benchmarks/step_breakdown.py [--model qwen3-100m|embedded|DIR] [--batch 1] [--context 256]

The model runs as a CPU worker's eager decode step does (kernelized for the CPU, projections
through their packs: workers/model/cpu_projections.py), over a paged pool holding `--context`
tokens per row. Forward hooks time each leaf layer, grouped by kind (attention projections, the
MLP's projections, paged attention, norms, rotary, embedding, output head); the rest of the step
(Python between layers, the batch's tensors) is `other`. The bound is the bytes one step must
read (every weight once, the rows' KV) over this machine's read bandwidth, measured here with the
same threads (a sum over a 256 MB tensor), so `% of bound` says how close the step comes to what
memory allows. Trade-off: hooks add a few microseconds per layer, and the compiled step (which
fuses across layers) cannot be split this way: this is the eager step's anatomy, the compiled
one's total is printed beside it where the model compiles. `--pools` then times the compiled step
on a second thread (as a worker's engine thread runs it) while this thread, which computed first,
keeps its OpenMP pool, and again once it gave it back (workers/engine/openmp.py).
`--gguf-activations int8`: a GGUF file's decode through the int8 GEMV, as the worker's flag.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

# benchmarks/ after the packages (a script's own directory comes first): benchmarks/gguf.py must
# not stand for gguf-py where a GGUF file loads
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))

KINDS = (  # (kind, what a module's class or attribute name holds), first match wins
    ("attention projections", ("wqkv", "wo", "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")),
    ("MLP projections", ("w_gate_up", "w_down", "gate_proj", "up_proj", "down_proj", "gate_up_proj")),
    ("paged attention", ("PagedAttention",)),
    ("norms", ("RMSNorm", "LayerNorm", "norm")),
    ("activation", ("SiluAndMul", "GeluAndMul", "act")),
    ("rotary", ("Rotary", "rope")),
    ("embedding", ("Embedding", "tok_embeddings", "embed_tokens")),
    ("output head", ("output", "lm_head")),
)


def kind_of(name: str, module: torch.nn.Module) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    cls = type(module).__name__
    for kind, keys in KINDS:
        if any(k == leaf or k in cls for k in keys):
            return kind
    return None


def read_bandwidth(threads: int) -> float:
    """Bytes per second this process reads: the best of 5 sums over a 256 MB bfloat16 tensor."""
    torch.set_num_threads(threads)
    x = torch.ones(128 << 20, dtype=torch.bfloat16)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(5))
    return x.numel() * x.element_size() / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def model_dir(name: str) -> Path:
    if name == "embedded":
        from workers.contract import DEFAULT_MODEL_DIR

        return Path(DEFAULT_MODEL_DIR)
    if name == "qwen3-100m":
        from vs_vllm_matrix import random_qwen3

        return random_qwen3()
    return Path(name)


class LayerClock:
    """Forward hooks that add each timed leaf layer's seconds to its kind (outermost match only)."""

    def __init__(self, model: torch.nn.Module):
        self.seconds: dict[str, float] = defaultdict(float)
        self._started: dict[int, float] = {}
        self._depth = 0
        self.handles = []
        for name, module in model.named_modules():
            kind = kind_of(name, module)
            if kind is None:
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre(module)))
            self.handles.append(module.register_forward_hook(self._post(module, kind)))

    def _pre(self, module):
        def hook(_m, _args):
            self._depth += 1
            if self._depth == 1:
                self._started[id(module)] = time.perf_counter()
        return hook

    def _post(self, module, kind: str):
        def hook(_m, _args, _out):
            if self._depth == 1:
                self.seconds[kind] += time.perf_counter() - self._started.pop(id(module))
            self._depth -= 1
        return hook

    def reset(self) -> None:
        self.seconds.clear()


def main(argv: list[str] | None = None) -> int:
    from decode_vs_transformers import Ours

    from workers.device.bind import BoundDevice
    from workers.engine.compiled import unfit_reason
    from workers.gguf.linear import GGUF_ACTIVATIONS, set_activations
    from workers.kernelize.apply import kernelize_for_device
    from workers.model.cpu_projections import install_cpu_projections
    from workers.model.loader import load_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-100m", help="qwen3-100m (made once, cached), embedded, or a directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256, help="tokens already in each row's KV")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", action="store_true", help="skip the compiled step's total")
    p.add_argument("--pools", action="store_true",
                   help="also the compiled step on a second thread, beside this thread's OpenMP pool, then without")
    p.add_argument("--gguf-activations", default="exact", choices=GGUF_ACTIVATIONS,
                   help="a GGUF file's decode activations, as the worker's `--gguf-activations`")
    args = p.parse_args(argv)

    bandwidth = read_bandwidth(args.threads)
    lm = load_model(model_dir(args.model), dtype=args.dtype)
    kernelize_for_device(lm.model, BoundDevice("cpu", 0, "cpu", "cpu", None, 0, False))
    install_cpu_projections(lm.model, "cpu", lm.dtype)
    set_activations(lm.model, args.gguf_activations)
    weights = sum(t.numel() * t.element_size() for t in lm.model.state_dict().values())
    max_len = args.context + 2 * args.steps + 16  # 4 warm-up steps, the hooked ones, the bare ones
    ours = Ours(lm, args.batch, args.context, max_len)
    kv_row = ours.kv.nbytes / ours.kv.max_tokens  # every layer's K and V of one position
    step_bytes = weights + kv_row * args.context * args.batch
    for _ in range(4):
        ours.step()
    clock = LayerClock(lm.model)
    totals = []
    for _ in range(args.steps):
        totals.append(_timed(ours.step))
    for h in clock.handles:
        h.remove()
    bare = statistics.median(_timed(ours.step) for _ in range(args.steps))  # without the hooks
    hooked = sum(totals)
    per_step = {kind: s / args.steps for kind, s in clock.seconds.items()}
    other = hooked / args.steps - sum(per_step.values())
    bound = step_bytes / bandwidth
    print(f"{args.model} ({lm.config.num_parameters / 1e6:.0f}M params, {args.dtype}), batch {args.batch}, "
          f"{args.context} tokens of context, {args.threads} threads")
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; one step reads {step_bytes / 1e6:.0f} MB: bound "
          f"{bound * 1e3:.2f} ms")
    print(f"eager step {bare * 1e3:.2f} ms median ({bound / bare:.0%} of bound); with the hooks "
          f"{hooked / args.steps * 1e3:.2f} ms, of which:")
    for kind, s in sorted(per_step.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:24s} {s * 1e3:7.2f} ms  {s / (hooked / args.steps):6.1%}")
    print(f"  {'other':24s} {other * 1e3:7.2f} ms  {other / (hooked / args.steps):6.1%}")
    if not args.no_compile and unfit_reason(lm.model) is None:
        compiled = Ours(lm, args.batch, args.context, max_len + (2 * args.steps if args.pools else 0), compiled=True)
        for _ in range(4):
            compiled.step()
        c = statistics.median(_timed(compiled.step) for _ in range(args.steps))
        print(f"compiled step {c * 1e3:.2f} ms median ({bound / c:.0%} of bound; "
              f"compiled in {compiled.compile_s:.0f} s)")
        if args.pools:
            pools(compiled.step, args.steps)
    return 0


def pools(step, steps: int) -> None:
    """The compiled step on a second thread, as a worker's engine thread runs it, while this thread
    (which computed before) keeps its OpenMP pool, then after it gave it back
    (workers/engine/openmp.py): the medians and the system time per step."""
    import resource
    import threading

    from workers.engine.openmp import release_pool

    def on_thread() -> tuple[float, float]:
        out = {}

        def run():
            sys0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            out["median"] = statistics.median(_timed(step) for _ in range(steps))
            out["sys"] = (resource.getrusage(resource.RUSAGE_SELF).ru_stime - sys0) / steps

        t = threading.Thread(target=run)
        t.start()
        t.join()
        return out["median"], out["sys"]

    kept, kept_sys = on_thread()
    release_pool()
    alone, alone_sys = on_thread()
    print(f"on a second thread: {kept * 1e3:.2f} ms median ({kept_sys * 1e3:.2f} ms of system time a step) "
          f"while this thread keeps its OpenMP pool, {alone * 1e3:.2f} ms ({alone_sys * 1e3:.2f} ms) once it "
          f"gave it back: {kept / alone:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
