"""The GGUF linear kernels on the real GPU: each type against its torch reference, timed against the
16-bit matmul of the same weights, with the bytes the packed blocks hold against bf16's; then the GGUF
experts' grouped GEMM against its reference and against one launch per active expert (`experts`).

Design: for each type the kernels decode (kernels_local/gguf_linear), random blocks with finite
fp16 scales (any byte pattern is a valid block once its scales are finite) make the weight of a
decode and a prefill shape (odd shapes: the gpu-marked tests of tests/test_kernels_gguf_linear.py);
the tuning the kernel mapping selects for this GPU runs the GEMV (decode) or the GEMM (prefill) in
the 16-bit dtype the device runs, compared with the dequantize-then-matmul reference (relative
error) and timed against `torch.nn.functional.linear` on the dequantized weight (the 16-bit path
every device takes today). The bytes column is the packed weight against the same weight in bf16
(the target for Q4_K_M layers: at most 0.32x). Trade-off: only this GPU's tuning and one dtype,
so the run fits the GPU check's budget (two compiled kernels per type).

    python benchmarks/gguf_kernels.py            # CUDA or ROCm only (scripts/gpu_check.sh runs it)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# byte offsets of each block's fp16 scales (d, and dmin or m where the type has one)
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
SHAPES = [(1, 4096, 4096), (512, 4096, 4096)]  # (M, N, K): decode (the GEMV), prefill (the GEMM)
TOLERANCE = 2e-2  # relative to the output's largest value: 16-bit outputs, another summation order


def random_weight(type_name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k / QK * TYPE_SIZE] of random blocks whose fp16 scales are finite (1e-4 to 1e-2)."""
    from kernels_local.gguf_linear import BLOCKS

    qk, size = BLOCKS[type_name]
    raw = torch.randint(0, 256, (n, k // qk, size), dtype=torch.uint8, device=gen.device, generator=gen)
    for offset in FP16_FIELDS[type_name]:
        scale = 10 ** (torch.rand(n, k // qk, device=gen.device, generator=gen) * 2 - 4)
        raw[..., offset:offset + 2] = scale.to(torch.float16).view(torch.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def timed(fn, rounds: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / rounds


def _tuning(layer_name: str, what: str) -> tuple[str, torch.dtype] | None:
    """(the tuning's name, the 16-bit dtype this GPU runs) of the Triton layer the mapping selects for
    `layer_name` here; None (said) where it selects no Triton layer."""
    from kernels_local.mapping import select

    kind = "rocm" if torch.version.hip else "cuda"
    cap = torch.cuda.get_device_capability(0)
    layer = select(kind, cap)[layer_name].layer
    if not layer.startswith(f"{layer_name}Triton"):
        print(f"{what}: not run: this GPU runs `{layer}` (no GGUF kernel)")
        return None
    act = torch.bfloat16 if cap >= (8, 0) or kind == "rocm" else torch.float16
    return layer.removeprefix(f"{layer_name}Triton").lower(), act


def kernels() -> int:
    from kernels_local.gguf_linear import BLOCKS, TUNINGS, dequantize_rows, gguf_linear, gguf_linear_reference

    if not torch.cuda.is_available():
        print("gguf kernels need a CUDA or ROCm device")
        return 2
    chosen = _tuning("GGUFLinear", "gguf kernels")
    if chosen is None:
        return 0
    name, act = chosen
    tuning = TUNINGS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    bad = 0
    for type_name in BLOCKS:
        for m, n, k in SHAPES:
            w = random_weight(type_name, n, k, gen)
            x = torch.randn(m, k, device="cuda", generator=gen).to(act)
            want = gguf_linear_reference(x, w, type_name).float()
            got = gguf_linear(x, w, type_name, tuning=tuning).float()
            err = float((got - want).abs().max() / want.abs().max())
            w16 = dequantize_rows(w, type_name, k).to(act)
            t = timed(lambda x=x, w=w, type_name=type_name: gguf_linear(x, w, type_name, tuning=tuning))
            t_16 = timed(lambda x=x, w16=w16: torch.nn.functional.linear(x, w16))
            bad += err > TOLERANCE
            print(f"gguf {name} {type_name:6} M={m:<4} N={n:<5} K={k:<5}: rel err {err:.1e}  "
                  f"bytes {w.numel() / (2 * n * k):.3f}x bf16  {t * 1e3:.3f} ms vs 16-bit {t_16 * 1e3:.3f} ms "
                  f"({t_16 / t:.2f}x)", flush=True)  # fmt: skip
    print("gguf kernels:", "ok" if not bad else f"{bad} outside tolerance")
    return 1 if bad else 0


EXPERTS = (64, 8, 2048, 768)  # experts, top-k, hidden, intermediate: a Qwen3-30B-A3B-like layer, narrower
EXPERT_TYPES = (("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q8_0", "Q8_0"), ("IQ4_XS", "IQ4_XS", "IQ4_XS"))


def experts() -> int:
    """The GGUF experts' grouped GEMM (one launch per projection over every active expert) against its
    reference and against the same experts run one GGUF linear launch per active expert and projection."""
    from kernels_local.gguf_linear import MOE_TUNINGS, TUNINGS, gguf_linear, gguf_moe, gguf_moe_experts

    chosen = _tuning("GGUFExperts", "gguf experts")
    if chosen is None:
        return 0
    name, act = chosen
    gen = torch.Generator(device="cuda").manual_seed(1)
    e, top_k, h, i = EXPERTS
    bad = 0
    for types in EXPERT_TYPES:
        gate, up, down = (random_weight(t, e * rows, k, gen).reshape(e, rows, -1)
                          for t, (rows, k) in zip(types, ((i, h), (i, h), (h, i)), strict=True))  # fmt: skip
        for tokens in (1, 512):
            x = torch.randn(tokens, h, device="cuda", generator=gen).to(act)
            ids = torch.rand(tokens, e, device="cuda", generator=gen).topk(top_k, dim=-1).indices
            weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
            args = (x, gate, up, down, types, ids, weights, "silu")
            want = gguf_moe_experts(*args).float()
            got = gguf_moe(*args, tuning=MOE_TUNINGS[name]).float()
            err = float((got - want).abs().max() / want.abs().max())
            per_expert = lambda a=args: gguf_moe_experts(  # noqa: E731
                *a, linear=lambda r, q, type_name: gguf_linear(r, q, type_name, tuning=TUNINGS[name]))
            t = timed(lambda a=args: gguf_moe(*a, tuning=MOE_TUNINGS[name]))
            t_loop = timed(per_expert, rounds=5)
            bad += err > TOLERANCE
            print(f"gguf experts {name} {'/'.join(types):20} T={tokens:<4} E={e} top-{top_k} H={h} I={i}: rel err "
                  f"{err:.1e}  grouped {t * 1e3:.3f} ms vs per-expert launches {t_loop * 1e3:.3f} ms "
                  f"({t_loop / t:.2f}x)", flush=True)  # fmt: skip
    print("gguf experts:", "ok" if not bad else f"{bad} outside tolerance")
    return 1 if bad else 0


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    return kernels() or experts()


if __name__ == "__main__":
    raise SystemExit(main())
