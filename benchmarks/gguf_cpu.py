"""The CPU's GGUF GEMV against the dequantized matmuls it replaces, side by side in one run.

    python benchmarks/gguf_cpu.py                    # a ~100M Llama's projections, Q4_K_M's types
    python benchmarks/gguf_cpu.py --hidden 2048 --mlp 5632 --layers 4 --rows 1 4 8

Every projection of a Llama of `--layers` x (q/k/v, o, gate/up, down) is quantized as llama.cpp's
Q4_K_M lays it out here (Q4_K, with v and down in Q6_K; `--type`: all in one type; random blocks
with finite scales: the time does not depend on the values), and one pass over all of them (a step's
projections, `--rows` rows each) is timed four ways, alternating per repetition:
kernels_local/gguf_linear's C++ kernel on the blocks (the GEMV below 16 rows, the matmul on
dequantized panels from 16), its int8 GEMV (`--gguf-activations int8`: the rows rounded to 8 bits
per 256 inputs first, as llama.cpp rounds them; from 16 rows the same panels), `F.linear` on the
same weights dequantized to float32 (what a CPU worker held before: `--dtype auto` is float32 on the
CPU) and to bfloat16 (the bar for keeping blocks packed). The weights of a pass are far larger than
the last-level cache, so every pass reads them from memory, as a served model's step does. Prints
the median time per pass and the kernel's speed-up over each. `--competitor PCT` times it all beside
a process busy PCT% of every 10 ms, as a router relaying streamed tokens is on a host whose every
core computes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels_local.gguf_linear import cpu  # noqa: E402
from kernels_local.gguf_linear.reference import BLOCKS  # noqa: E402


def blocks(type_name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random uint8 blocks [n, k / QK * size] whose fp16 scales are finite (0.001 to 0.01)."""
    qk, size = BLOCKS[type_name]
    raw = torch.randint(0, 256, (n, k // qk, size), dtype=torch.uint8, generator=gen)
    offsets = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q5_K": (0, 2)}[type_name]
    for o in offsets:
        scales = (torch.rand(n, k // qk, generator=gen) * 0.009 + 0.001).half()
        raw[..., o : o + 2] = scales.view(torch.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--kv", type=int, default=256, help="K (and V) projection rows")
    p.add_argument("--mlp", type=int, default=2816)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, cpu.GEMV_MAX_M - 1])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--type", choices=sorted(cpu.TYPES), default=None,
                   help="every projection in this type (default: Q4_K_M's mix of Q4_K and Q6_K)")
    p.add_argument("--competitor", type=float, default=0.0, metavar="PCT",
                   help="a process busy PCT%% of every 10 ms meanwhile (a router relaying streamed tokens on a host "
                        "whose every core computes): how much a thread the OS preempts holds a pass back")
    a = p.parse_args()
    if not 0 <= a.competitor < 100:
        sys.exit(f"--competitor {a.competitor}: a share of a core in percent, 0 to under 100, expected")
    if not cpu.KERNEL.load().available:
        sys.exit(f"the C++ kernel is not available here: {cpu.KERNEL.load().reason}")
    gen = torch.Generator().manual_seed(0)
    h = a.hidden
    shapes = [("Q4_K", h + a.kv, h), ("Q6_K", a.kv, h), ("Q4_K", h, h), ("Q4_K", 2 * a.mlp, h), ("Q6_K", h, a.mlp)]
    if a.type:
        shapes = [(a.type, n, k) for _, n, k in shapes]
    layers = [(t, blocks(t, n, k, gen)) for _ in range(a.layers) for t, n, k in shapes]
    dense32 = [cpu.dequantize(q, t, q.shape[1] // BLOCKS[t][1] * BLOCKS[t][0]) for t, q in layers]
    dense16 = [w.bfloat16() for w in dense32]
    params = sum(w.numel() for w in dense32)
    packed = sum(q.numel() for _, q in layers)
    print(f"{a.layers} layers, {params / 1e6:.1f}M weights: packed {packed / 2**20:.0f} MiB, float32 "
          f"{params * 4 / 2**20:.0f} MiB, bfloat16 {params * 2 / 2**20:.0f} MiB; {torch.get_num_threads()} threads; "
          f"{cpu.KERNEL.load().reason}")
    stop = multiprocessing.Event()
    competitor = multiprocessing.Process(target=_busy, args=(a.competitor / 100, stop), daemon=True)
    if a.competitor:
        competitor.start()
        print(f"beside a process busy {a.competitor:g}% of every 10 ms")
    print(f"{'rows':>5} {'kernel ms':>9} {'int8 ms':>9} {'fp32 ms':>9} {'bf16 ms':>9} {'vs fp32':>8} {'vs bf16':>8} "
          f"{'int8 vs kernel':>14}")
    for m in a.rows:
        rows = {h: torch.randn(m, h, generator=gen), a.mlp: torch.randn(m, a.mlp, generator=gen)}  # by K
        inputs = {"gemv": rows, "int8": rows, "fp32": rows, "bf16": {k: x.bfloat16() for k, x in rows.items()}}

        def run(kind: str, inputs: dict = inputs) -> float:
            started = time.perf_counter()
            for (t, q), w32, w16 in zip(layers, dense32, dense16, strict=True):
                x = inputs[kind][w32.shape[1]]
                if kind in ("gemv", "int8"):
                    cpu.gguf_linear_cpu(x, q, t, None, int8=kind == "int8")
                else:
                    F.linear(x, w32 if kind == "fp32" else w16)
            return time.perf_counter() - started

        times: dict[str, list[float]] = {"gemv": [], "int8": [], "fp32": [], "bf16": []}
        for kind in times:
            run(kind)  # warm: first calls, page faults
        for _ in range(a.repeats):
            for kind in times:
                times[kind].append(run(kind))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{m:>5} {med['gemv']:>9.2f} {med['int8']:>9.2f} {med['fp32']:>9.2f} {med['bf16']:>9.2f} "
              f"{med['fp32'] / med['gemv']:>7.2f}x {med['bf16'] / med['gemv']:>7.2f}x "
              f"{med['gemv'] / med['int8']:>13.2f}x", flush=True)
    stop.set()


def _busy(share: float, stop, period: float = 0.010) -> None:
    """Spin `share` of every `period` seconds, sleep the rest, until `stop`."""
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < share * period:
            pass
        time.sleep(period * (1 - share))


if __name__ == "__main__":
    main()
