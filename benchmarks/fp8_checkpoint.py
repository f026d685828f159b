"""A pre-quantized fp8 checkpoint per simulated device: the weight bytes each execution holds against the
bf16 model, and the decode step against the bf16 model's, side by side in one run.

Design: the embedded model (a trained Llama of 4 layers) is written in the block-wise `quant_method:
fp8` format (`--format block`, the default) or by compressed-tensors (`--format compressed-tensors`,
`FP8_DYNAMIC`: per-channel weights, per-token activations; slower to write), or `--format moe` for a
tiny Qwen3-MoE with fp8 experts (compressed-tensors' compressor per tensor). Each simulated device
loads it in bf16, kernelizes as its worker would and runs the fp8 step; the table shows its
execution, the bytes its quantized layers hold (fp8 bytes and scales, or the widened weights) against
the same layers in bf16 (target: at most 0.55x on every device from sm_80 up), and the median decode
step (batch `--batch`, a paged KV cache, as the engine runs it on this CPU) against the bf16 model's,
timed in alternating rounds so machine noise hits both alike. On a CPU every execution computes in
torch (the dequantized weights, or the references of the kernels a GPU would run), so the step ratio
says what a simulated device costs here, not what the GPU kernel gains; `--kernels` instead checks
and times the Triton kernels against their torch references on the real GPU (scripts/gpu_check.sh).

    python benchmarks/fp8_checkpoint.py [--format block|compressed-tensors|moe] [--batch 8] [--steps 30]
    python benchmarks/fp8_checkpoint.py --kernels          # CUDA or ROCm only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEVICES = {"cpu": ("cpu", None), "sm_75": ("cuda", (7, 5)), "sm_80": ("cuda", (8, 0)), "sm_86": ("cuda", (8, 6)),
           "sm_89": ("cuda", (8, 9)), "sm_90": ("cuda", (9, 0)), "gfx90a": ("rocm", (9, 0)),
           "gfx942": ("rocm", (9, 4))}  # fmt: skip
TARGET = 0.55  # at most this share of the bf16 bytes where the device keeps the fp8 bytes


def checkpoint(fmt: str, tmp: Path) -> tuple[Path, Path]:
    """(the fp8 checkpoint, its unquantized source) in `tmp`."""
    from tests.fp8_checkpoints import block_fp8_checkpoint, compressed_tensors_checkpoint, quantize_checkpoint
    from workers.contract import DEFAULT_MODEL_DIR

    if fmt == "moe":
        from tests.family_checkpoints import make_family_checkpoint

        src = make_family_checkpoint("qwen3_moe", tmp / "src")
        return quantize_checkpoint(src, tmp / "fp8", "compressed-tensors"), src
    if fmt == "block":
        return block_fp8_checkpoint(tmp / "fp8"), DEFAULT_MODEL_DIR
    return compressed_tensors_checkpoint(tmp / "fp8", "FP8_DYNAMIC"), DEFAULT_MODEL_DIR


def loaded(ckpt: Path, device: str | None):
    """The model in bf16, kernelized for the simulated `device` and prepared by the fp8 step."""
    from workers.device.bind import BoundDevice
    from workers.kernelize.apply import kernelize_for_device
    from workers.model.loader import load_model
    from workers.quant.prepare import prepare_fp8_checkpoint

    lm = load_model(ckpt, "bfloat16")
    if device is None:
        return lm, None
    device_type, cap = DEVICES[device]
    kernelize_for_device(lm.model, BoundDevice(device_type, 0, "GPU-sim", "sim", cap, 0, True))
    return lm, prepare_fp8_checkpoint(lm.model, None, device_type, cap)


def bf16_bytes(model) -> int:
    """Bytes the quantized layers would take in bf16 (their weights' elements, 2 bytes each)."""
    from workers.quant.experts import Fp8FusedMoE
    from workers.quant.linear import Fp8CheckpointLinear

    total = 0
    for m in model.modules():
        if isinstance(m, Fp8CheckpointLinear):
            total += 2 * m.in_features * m.out_features
        elif isinstance(m, Fp8FusedMoE):
            e, n, k = m.w_gate_up_scale.shape[0], *(m.w_gate_up.shape[1:] if m.w_gate_up is not None
                                                   else m.w_gate_up_q.shape[1:])  # fmt: skip
            total += 2 * e * (n * k + n // 2 * k)  # gate_up [2I, H] and down [H, I]
    return total


def step_ms(ours, base, steps: int) -> tuple[float, float]:
    """Median decode step of each (ms), in alternating rounds."""
    for _ in range(3):
        ours.step(), base.step()
    t_ours, t_base = [], []
    for _ in range(steps):
        for runner, times in ((ours, t_ours), (base, t_base)):
            t0 = time.perf_counter()
            with torch.inference_mode():
                runner.step()
            times.append(time.perf_counter() - t0)
    return statistics.median(t_ours) * 1e3, statistics.median(t_base) * 1e3


def devices_table(args) -> int:
    from benchmarks.decode_vs_transformers import Ours

    with tempfile.TemporaryDirectory() as tmp:
        ckpt, src = checkpoint(args.format, Path(tmp))
        base_lm, _ = loaded(src, None)
        print(f"{args.format} fp8 checkpoint of {base_lm.config.architecture}, decode batch {args.batch}, "
              f"{torch.get_num_threads()} threads")  # fmt: skip
        print(f"{'device':8} {'execution':12} {'fp8 layers':>10} {'bytes':>10} {'bf16 bytes':>10} {'ratio':>6} "
              f"{'step ms':>8} {'bf16 ms':>8} {'x bf16':>6}")  # fmt: skip
        failed = []
        for device in args.devices:
            lm, s = loaded(ckpt, device)
            ref = bf16_bytes(lm.model)
            ratio = s["weight_bytes"] / ref
            ours = Ours(lm, args.batch, 16, 16 + args.steps + 8)
            base = Ours(base_lm, args.batch, 16, 16 + args.steps + 8)
            ms, base_ms = step_ms(ours, base, args.steps)
            keeps = s["execution"] != "dequantized"
            if keeps and ratio > TARGET:
                failed.append(device)
            print(f"{device:8} {s['execution']:12} {s['layers'] + s['expert_layers']:>10} {s['weight_bytes']:>10} "
                  f"{ref:>10} {ratio:>6.3f} {ms:>8.2f} {base_ms:>8.2f} {ms / base_ms:>6.2f}", flush=True)  # fmt: skip
    print(f"target: at most {TARGET}x of bf16 where the fp8 bytes are kept: "
          f"{'met' if not failed else 'missed on ' + ', '.join(failed)}")
    return 1 if failed else 0


def kernels(args) -> int:
    """The fp8 checkpoint kernels on the real GPU against their torch references, timed against bf16."""
    from kernels_local.fp8_linear import checkpoint as ck
    from kernels_local.fp8_linear.fp8_linear import SM80, SM90
    from kernels_local.fused_moe import fp8 as moe
    from kernels_local.fused_moe.fused_moe import HOPPER

    if not torch.cuda.is_available():
        print("--kernels needs a CUDA or ROCm device")
        return 2
    dev, gen = "cuda", torch.Generator(device="cuda").manual_seed(0)
    native = torch.cuda.get_device_capability() >= (8, 9) or torch.version.hip is not None
    fmt = "e4m3fnuz" if torch.version.hip and "gfx94" in torch.cuda.get_device_properties(0).gcnArchName else "e4m3fn"
    bad = 0
    for m, n, k in ((1, 4096, 4096), (32, 4096, 4096), (512, 14336, 4096)):
        x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).clamp(-0.4, 0.4)
        s_rows = (w.abs().amax(1, keepdim=True) / 448).float()  # [N, 1]
        q_rows = (w / s_rows).to(torch.float8_e4m3fn)
        cases = [("w8a16", partial(ck.w8a16_linear, x, q_rows.view(torch.uint8), s_rows, 1, k, None, fmt="e4m3fn",
                                   tuning=SM80),
                  partial(ck.w8a16_reference, x, q_rows.view(torch.uint8), s_rows, 1, k, None, "e4m3fn"))]  # fmt: skip
        if native and fmt == "e4m3fn":
            sb = torch.rand(-(-n // 128), -(-k // 128), device=dev, generator=gen) * 1e-3 + 1e-4
            block = (x, q_rows, sb, 128, 128, None, "dynamic_group", None)
            cases.append(("w8a8 block", partial(ck.w8a8_linear, *block, fmt=fmt, tuning=SM90),
                          partial(ck.w8a8_reference, *block, fmt)))  # fmt: skip
        t_bf16 = timed(partial(torch.nn.functional.linear, x, w.to(torch.bfloat16)))
        for name, run, ref in cases:
            want = ref().float()
            err = float((run().float() - want).abs().max() / want.abs().max())
            t = timed(run)
            bad += err > 2e-2
            print(f"{name:11} M={m:<4} N={n} K={k}: rel err {err:.1e}  {t * 1e3:.3f} ms vs bf16 {t_bf16 * 1e3:.3f} ms "
                  f"({t_bf16 / t:.2f}x)")  # fmt: skip
    # the fused MoE over fp8 experts (Qwen3-30B-A3B's shapes: 128 experts, top 8, H 2048, I 768)
    e, h, i, t = 128, 2048, 768, 32
    x = torch.randn(t, h, device=dev, generator=gen, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=dev, generator=gen)[:8] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 8, device=dev, generator=gen), -1)
    q = [(torch.randn(e, r, c, device=dev, generator=gen) * 8).clamp(-400, 400).to(torch.float8_e4m3fn)
         for r, c in ((2 * i, h), (h, i))]  # fmt: skip
    for execution in ("weight_only", "native") if native and fmt == "e4m3fn" else ("weight_only",):
        stored = q if execution == "native" else [t.view(torch.uint8) for t in q]
        ex = SimpleNamespace(fp8_fmt="e4m3fn", execution=execution, activations="dynamic_token", activation="silu",
                             alpha=1.702, limit=7.0, b_gate_up=None, b_down=None, input_scales=None,
                             w_gate_up_q=stored[0], w_down_q=stored[1],
                             w_gate_up_scale=torch.full((e, 2 * i, 1), 1e-3, device=dev),
                             w_down_scale=torch.full((e, h, 1), 1e-3, device=dev), gate_up_groups=(1, h),
                             down_groups=(1, i))  # fmt: skip
        run = partial(moe.fused_moe_fp8, x, ex, ids, weights, native=execution == "native", tuning=HOPPER)
        want = moe.fused_moe_fp8_reference(x, ex, ids, weights).float()
        err = float((run().float() - want).abs().max() / want.abs().max())
        bad += err > 3e-2
        print(f"fp8 MoE {execution:11} T={t} E={e} top-8 H={h} I={i}: rel err {err:.1e}  {timed(run) * 1e3:.3f} ms")
    print("fp8 checkpoint kernels:", "ok" if not bad else f"{bad} outside tolerance")
    return 1 if bad else 0


def timed(fn, rounds: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rounds):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / rounds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=("block", "compressed-tensors", "moe"), default="block")
    p.add_argument("--devices", nargs="+", choices=sorted(DEVICES), default=list(DEVICES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kernels", action="store_true", help="check and time the Triton kernels on the real GPU")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    return kernels(args) if args.kernels else devices_table(args)


if __name__ == "__main__":
    raise SystemExit(main())
