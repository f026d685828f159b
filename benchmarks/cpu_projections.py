"""A CPU projection through torch's matmul, its oneDNN pack and its brgemm column panels, side by side.

    python benchmarks/cpu_projections.py [--threads 1] [--rows 1 4 16 32 64]

Design: for each matrix shape (the embedded model's gate/up and LM head, a 2026 model's
attention projection and one of its experts) and dtype, `--copies` distinct weights are
multiplied in turn, so their bytes come from memory rather than a warm cache, as a real
model's layers do; each round times `F.linear` (MKL in float32, oneDNN with the weight
reordered per call in bfloat16), then `mkldnn._linear_pointwise` over the weights packed
once (workers/model/cpu_projections.py), then brgemm over the weights laid out once as column
panels (kernels_local/panel_linear/cpu.py, where the panel GEMM builds and the reduction fits it),
alternately, and the median per matrix is printed with the ratios (torch / packed: above 1 means
the pack is faster; packed / panels: above 1 means the panels are, which a worker then uses). A matrix below
`MIN_PACKED_ELEMENTS` is marked: the worker leaves those to torch; so is a dtype this CPU's
oneDNN cannot pack (bfloat16 without AVX-512 or AVX-NE-CONVERT), which is not timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels_local.panel_linear import cpu as cpu_gemm  # noqa: E402
from workers.model.cpu_projections import MIN_PACKED_ELEMENTS, pack, packing_refusal  # noqa: E402

# (what, out features N, in features K, copies): distinct weights cycled per timing
SHAPES = (
    ("embedded model attention q/k/v", 512, 256, 16),
    ("embedded model gate/up", 1376, 256, 16),
    ("embedded model LM head", 4096, 256, 4),
    ("Qwen3-8B-like attention q/k/v", 6144, 4096, 2),
    ("Qwen3-30B-A3B-like expert gate/up", 1536, 2048, 8),
)


def timed(fn, rounds: int) -> float:
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - t0) / rounds


def time_sides(x: torch.Tensor, weights: list, packs: list, panels: list | None, rounds: int) -> list[float]:
    """Median microseconds per matrix of `F.linear`, the packed product and (`panels` given) the
    panel GEMM, alternately."""

    def plain():
        for w in weights:
            F.linear(x, w)

    def packed():
        for p in packs:
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    def panel():
        for p in panels:
            cpu_gemm.linear(x, p, None)

    sides = [plain, packed] + ([panel] if panels else [])
    for side in sides:  # warm-up: oneDNN compiles this row count's kernels
        side()
    times = [[] for _ in sides]
    for _ in range(rounds):
        for side, ts in zip(sides, times, strict=True):
            ts.append(timed(side, 3) / len(weights))
    return [statistics.median(ts) * 1e6 for ts in times]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16, 32, 64])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us per matrix, median of {args.rounds}")
    gemm = cpu_gemm.load()
    print(f"panels: {gemm.reason}")
    print(f"{'matrix':<36}{'dtype':<10}{'rows':>5}{'torch us':>10}{'packed us':>11}{'ratio':>8}{'panels us':>11}"
          f"{'ratio':>8}")
    g = torch.Generator().manual_seed(0)
    names = [n for n in args.dtype if packing_refusal(getattr(torch, n)) is None]
    for name in sorted(set(args.dtype) - set(names)):  # the worker leaves these to torch (rows padded only)
        print(f"{name}: not timed, this CPU's oneDNN cannot pack it ({packing_refusal(getattr(torch, name))})")
    for what, n, k, copies in SHAPES:
        for name in names:
            dtype = getattr(torch, name)
            weights = [torch.randn(n, k, generator=g).to(dtype) for _ in range(copies)]
            packs = [pack(w) for w in weights]
            panels = [cpu_gemm.panels(w) for w in weights] if gemm.available and cpu_gemm.fits(weights[0]) else None
            small = "" if n * k >= MIN_PACKED_ELEMENTS else "  (below MIN_PACKED_ELEMENTS: torch's)"
            for rows in args.rows:
                x = torch.randn(rows, k, generator=g).to(dtype)
                t, p, *b = time_sides(x, weights, packs, panels, args.rounds)
                cells = f"{b[0]:>11.1f}{p / b[0]:>7.2f}x" if b else f"{'-':>11}{'-':>8}"
                print(f"{what:<36}{name:<10}{rows:>5}{t:>10.1f}{p:>11.1f}{t / p:>7.2f}x{cells}{small}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
