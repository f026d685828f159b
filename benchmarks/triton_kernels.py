"""Our Triton kernels vs torch on the local GPU: correctness first, then time, side by side.

For each shape, every tuning of a kernel (the one `select()` picks for this GPU is marked
`*`) and the torch baseline are checked against the torch reference, then timed in
interleaved rounds (CUDA events, median), so machine noise hits all alike. Ratios are
torch time / kernel time: above 1 means the kernel is faster. Baselines: the eager torch
reference for RMSNorm and SiluAndMul; `F.linear` in bf16 and the dequantize-then-matmul
reference for the fp8 linear (native e4m3 only from sm_89); for paged decode attention, the
torch path (gather the rows' blocks, one SDPA) over the same scattered block tables, in
Llama-shaped rows and in Gemma-shaped ones (head dim 256, soft-capped scores, sliding
windows: the kernel reads only the window's positions, the torch path gathers every one and
masks). Paged attention's GB/s counts the K/V bytes the rows attend. For the fused MoE, the
torch path (one matmul pair per active expert) on Qwen3-30B-A3B and gpt-oss-20b shaped
experts (bf16, random routing), at decode and prefill token counts; its GB/s counts the
weight bytes of the experts the step touches. For the LoRA delta, the torch path (a gather, two
matmuls and a scatter per adapter) on a Llama-8B-shaped q/k/v with four adapters of ranks 8 to 64
and base rows mixed in one batch, decode rows only and a prefill chunk beside them.

    python benchmarks/triton_kernels.py [--rounds 50] [--only rmsnorm silu fp8 paged moe lora]

Without CUDA it prints one skip line and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RMS_SHAPES = [(1, 4096), (32, 4096), (256, 2048), (4096, 4096), (16, 8192)]  # (tokens, hidden)
SILU_SHAPES = [(1, 14336), (32, 14336), (2048, 11008)]  # (tokens, intermediate)
GEMM_SHAPES = [(1, 4096, 4096), (32, 4096, 4096), (256, 14336, 4096), (1024, 4096, 14336)]  # (M, N, K)
PAGED_SHAPES = [(1, 512), (32, 512), (32, 4096), (128, 1024)]  # (decode rows, tokens each); 32/8 heads, D 128
GEMMA_HEADS = (16, 8, 256)  # Gemma 2 9B: query heads, KV heads, head dim (query_pre_attn_scalar 256)
GEMMA_CASES = [  # (layer, decode rows, tokens each, window, softcap)
    ("Gemma 2 global", 32, 4096, None, 50.0),
    ("Gemma 2 local", 32, 8192, 4096, 50.0),
    ("Gemma 3 local", 32, 4096, 1024, None),
]
MOE_CASES = [  # (model, experts, top-k, hidden, intermediate, bias, activation)
    ("Qwen3-30B-A3B", 128, 8, 2048, 768, False, "silu"),
    ("gpt-oss-20b", 32, 4, 2880, 2880, True, "swiglu_oai"),
]
MOE_TOKENS = (1, 32, 512)
LORA_CASES = [(0, 32), (0, 256), (512, 32)]  # (prefill rows of one adapter, decode rows over 4 adapters and base)
KERNELS = ["rmsnorm", "silu", "fp8", "paged", "moe", "lora"]


def _time(fns: dict, rounds: int) -> dict[str, float]:
    """Median microseconds per call, calls interleaved round by round."""
    for fn in fns.values():  # warm up: compile, autotune caches, allocator
        fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples[name].append(start.elapsed_time(end) * 1000.0)
    return {k: statistics.median(v) for k, v in samples.items()}


def _report(title: str, times: dict[str, float], baseline: str, nbytes: int | None = None) -> None:
    base = times[baseline]
    parts = []
    for name, us in times.items():
        bw = f", {nbytes / us / 1e3:.0f} GB/s" if nbytes else ""
        ratio = "" if name == baseline else f", x{base / us:.2f}"
        parts.append(f"{name} {us:.1f} us{bw}{ratio}")
    print(f"{title}: " + "; ".join(parts))


def bench_rmsnorm(m: int, n: int, chosen: str, rounds: int) -> None:
    from kernels_local.rmsnorm import TUNINGS, rms_norm, rms_norm_reference

    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = rms_norm_reference(x, w, 1e-6)
    fns = {"torch": lambda: rms_norm_reference(x, w, 1e-6)}
    for name, t in TUNINGS.items():
        torch.testing.assert_close(rms_norm(x, w, 1e-6, t), ref)
        fns[name + ("*" if name == chosen else "")] = lambda t=t: rms_norm(x, w, 1e-6, t)
    _report(f"RMSNorm [{m}, {n}] bf16", _time(fns, rounds), "torch", 2 * x.numel() * 2)


def bench_silu(m: int, i: int, chosen: str, rounds: int) -> None:
    from kernels_local.activation import TUNINGS, silu_and_mul, silu_and_mul_reference

    x = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16)
    ref = silu_and_mul_reference(x)
    fns = {"torch": lambda: silu_and_mul_reference(x)}
    for name, t in TUNINGS.items():
        torch.testing.assert_close(silu_and_mul(x, t), ref)
        fns[name + ("*" if name == chosen else "")] = lambda t=t: silu_and_mul(x, t)
    _report(f"SiluAndMul [{m}, 2x{i}] bf16", _time(fns, rounds), "torch", 3 * m * i * 2)


def bench_fp8(m: int, n: int, k: int, chosen: str, native_ok: bool, rounds: int) -> None:
    import torch.nn.functional as F

    from kernels_local.fp8_linear import TUNINGS, fp8_linear, fp8_linear_reference
    from workers.quant.fp8_convention import EMULATED_E4M3
    from workers.quant.fp8_quantize import quantize_weight_per_channel

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    q_emulated, scale = quantize_weight_per_channel(w, EMULATED_E4M3)
    ref = fp8_linear_reference(x, q_emulated, scale, None, "e4m3fn")
    fns = {"bf16 F.linear": lambda: F.linear(x, w), "torch dequant": lambda: fp8_linear_reference(
        x, q_emulated, scale, None, "e4m3fn")}  # fmt: skip
    variants = [(False, q_emulated)]
    if native_ok:
        variants.append((True, q_emulated.view(torch.float8_e4m3fn)))
    for native, q in variants:
        for name, t in TUNINGS.items():
            if name == "rocm":
                continue
            label = f"{'native' if native else 'emulated'}-{name}" + ("*" if name == chosen else "")
            try:
                y = fp8_linear(x, q, scale, None, native=native, fmt="e4m3fn", tuning=t)
            except Exception as e:  # a tile shape for a bigger GPU: out of shared memory here
                print(f"  {label}: not run on this GPU ({type(e).__name__}: {str(e)[:80]})")
                continue
            torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
            fns[label] = lambda q=q, t=t, native=native: fp8_linear(
                x, q, scale, None, native=native, fmt="e4m3fn", tuning=t
            )
    _report(f"Fp8Linear M={m} N={n} K={k}", _time(fns, rounds), "bf16 F.linear")


def bench_paged(rows: int, length: int, chosen: str, rounds: int, heads: tuple[int, int, int] = (32, 8, 128),
                layer: str = "", window: int | None = None, softcap: float | None = None) -> None:
    from kernels_local.paged_attention import TUNINGS, paged_decode, paged_decode_reference

    bs, (hq, hkv, d) = 16, heads
    per_row = -(-length // bs)
    blocks = torch.randperm(rows * per_row + 7, device="cuda")  # scattered over a slightly bigger pool
    tables = blocks[: rows * per_row].view(rows, per_row)
    kv = torch.randn(2, hkv, rows * per_row + 7, bs, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((rows,), length, device="cuda")
    options = {"window": window, "softcap": softcap, "scale": d**-0.5}
    ref = paged_decode_reference(q, kv, tables, lens, length, **options)
    fns = {"torch": lambda: paged_decode_reference(q, kv, tables, lens, length, **options)}
    for name, t in TUNINGS.items():
        out = paged_decode(q, kv, tables, lens, length, t, **options)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        fns[name + ("*" if name == chosen else "")] = lambda t=t: paged_decode(q, kv, tables, lens, length, t,
                                                                               **options)  # fmt: skip
    shown = f" window {window}" * (window is not None) + f" softcap {softcap}" * (softcap is not None)
    title = (f"PagedAttention{' ' + layer if layer else ''} {rows} rows x {length} tokens, "
             f"{hq}/{hkv} heads D {d}{shown} bf16")
    _report(title, _time(fns, rounds), "torch", 2 * rows * min(length, window or length) * hkv * d * 2)


def bench_moe(case: tuple, tokens: int, chosen: str, rounds: int) -> None:
    from kernels_local.fused_moe import TUNINGS, fused_moe, fused_moe_reference

    model, e, k, h, i, bias, activation = case
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    w_gate_up, w_down = torch.randn(e, 2 * i, h, **bf16) / h**0.5, torch.randn(e, h, i, **bf16) / i**0.5
    b_gate_up, b_down = (torch.randn(e, 2 * i, **bf16), torch.randn(e, h, **bf16)) if bias else (None, None)
    x = torch.randn(tokens, h, **bf16)
    logits = torch.randn(tokens, e, device="cuda")
    topk_weights, topk_ids = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    args = (x, w_gate_up, w_down, topk_ids, topk_weights, b_gate_up, b_down, activation)
    ref = fused_moe_reference(*args)
    fns = {"torch": lambda: fused_moe_reference(*args)}
    for name, t in TUNINGS.items():
        torch.testing.assert_close(fused_moe(*args, tuning=t), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
        fns[name + ("*" if name == chosen else "")] = lambda t=t: fused_moe(*args, tuning=t)
    touched = topk_ids.unique().numel()
    _report(f"FusedMoE {model} {tokens} tokens, E {e} top-{k}, H {h} I {i} ({touched} experts touched) bf16",
            _time(fns, rounds), "torch", touched * 3 * h * i * 2)  # fmt: skip


def bench_lora(prefill: int, decode: int, chosen: str, rounds: int) -> None:
    from kernels_local.lora_sgmv import TUNINGS, lora_sgmv
    from workers.lora.adapter import LoraAdapter, LoraTarget
    from workers.lora.apply import LoraBatch, add_lora
    from workers.lora.stack import build_stack

    k, parts = 4096, ((0, 4096), (4096, 1024), (5120, 1024))  # Llama 3 8B's q/k/v
    bf16 = {"device": "cuda", "dtype": torch.bfloat16}
    def pairs(r: int) -> tuple:
        return tuple(LoraTarget(off, size, torch.randn(r, k, **bf16) / 64, torch.randn(size, r, **bf16) / 8)
                     for off, size in parts)

    adapters = [LoraAdapter(f"a{r}", None, r, r, False, 1.0, {"wqkv": pairs(r)}) for r in (8, 16, 32, 64)]
    rows = [adapters[0]] * prefill + [adapters[i % 4] if i % 5 else None for i in range(decode)]
    batch = LoraBatch.from_rows(rows, "cuda")
    x, out = torch.randn(len(rows), k, **bf16), torch.randn(len(rows), 6144, **bf16)
    ref = out.clone()
    add_lora("wqkv", x, ref, batch)
    stack = build_stack(batch.adapters, "wqkv", "cuda")
    fns = {"torch": lambda: add_lora("wqkv", x, out.clone(), batch)}
    for name, t in TUNINGS.items():
        got = out.clone()
        lora_sgmv(x, got, stack, batch.segments, tuning=t)
        torch.testing.assert_close(got, ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
        fns[name + ("*" if name == chosen else "")] = lambda t=t: lora_sgmv(x, out.clone(), stack, batch.segments,
                                                                            tuning=t)
    _report(f"LoraDelta {prefill} prefill + {decode} decode rows, 4 adapters r 8..64, q/k/v 4096->6144 bf16",
            _time(fns, rounds), "torch")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument(
        "--only", nargs="*", default=KERNELS, choices=KERNELS,
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/triton_kernels.py: skipped, no CUDA device "
            "(the kernels need a GPU; CPU runs the torch reference)"
        )
        return 0
    from kernels_local.mapping import select

    cap = torch.cuda.get_device_capability(0)
    kind = "rocm" if torch.version.hip else "cuda"
    choices = select(kind, cap)
    print(f"{torch.cuda.get_device_name(0)} ({kind} {cap[0]}.{cap[1]}); chosen: "
          + ", ".join(f"{k}={v.variant}" for k, v in choices.items()))  # fmt: skip
    tuning = {"triton-sm70": "sm70", "triton-sm90": "sm90", "triton-rocm": "rocm"}
    if "rmsnorm" in args.only:
        for m, n in RMS_SHAPES:
            bench_rmsnorm(m, n, tuning.get(choices["RMSNorm"].variant, ""), args.rounds)
    if "silu" in args.only:
        for m, i in SILU_SHAPES:
            bench_silu(m, i, tuning.get(choices["SiluAndMul"].variant, ""), args.rounds)
    if "fp8" in args.only and kind == "cuda" and cap >= (8, 0):
        fp8_tuning = {"Fp8LinearTritonEmulatedSm80": "sm80", "Fp8LinearTritonNativeSm89": "sm89",
                      "Fp8LinearTritonNativeSm90": "sm90"}.get(choices["Fp8Linear"].layer, "")  # fmt: skip
        for m, n, k in GEMM_SHAPES:
            bench_fp8(m, n, k, fp8_tuning, cap >= (8, 9), args.rounds)
    if "paged" in args.only:
        chosen = tuning.get(choices["PagedAttention"].variant, "")
        for rows, length in PAGED_SHAPES:
            bench_paged(rows, length, chosen, args.rounds)
        for layer, rows, length, window, softcap in GEMMA_CASES:
            bench_paged(rows, length, chosen, args.rounds, GEMMA_HEADS, layer, window, softcap)
    if "moe" in args.only:
        chosen = tuning.get(choices["FusedMoE"].variant, "")
        for case in MOE_CASES:
            for tokens in MOE_TOKENS:
                bench_moe(case, tokens, chosen, args.rounds)
    if "lora" in args.only:
        chosen = tuning.get(choices["LoraDelta"].variant, "")
        for prefill, decode in LORA_CASES:
            bench_lora(prefill, decode, chosen, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
