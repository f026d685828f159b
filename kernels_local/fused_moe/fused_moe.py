"""Fused mixture-of-experts (the experts of one layer) as a grouped Triton GEMM, its torch
reference, and per-architecture launch tuning.

In the spirit of vLLM's and SGLang's fused MoE: the `T x K` token-expert pairs are sorted by
expert and each expert's run padded to a multiple of `BLOCK_M` on the device (`align_pairs`, no
host sync); one grouped GEMM kernel then serves both matmuls, each program taking one `BLOCK_M`
block of one expert's pairs and `BLOCK_N` output columns, so one launch covers every active
expert and reads no weight of an idle one. Gate and up accumulate side by side and are activated
in the epilogue (the `[P, 2I]` pre-activation never exists); the down GEMM applies the router
weight, and torch sums over top-k (no atomics, no order-dependent adds). The trade-off: padding
wastes up to `BLOCK_M - 1` rows per active expert (most at decode, where the weights' bytes
dominate anyway), and the activated rows make one round trip through memory between the launches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique
from kernels_local.expert_pairs import _activate, _moe_tile, align_pairs  # fp8.py and mxfp4.py import them here

from .torch_path import fused_moe_torch

ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")
# Runtime integers compiled once for every value (no divisibility or ==1 specialization): they
# change from step to step (`top_k` is 1 for the down GEMM), so `compile_specs` declares exactly
# the launches the wrapper makes.
_UNSPECIALIZED = ("max_padded", "num_pairs", "top_k")
_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Triton's interpreter (TRITON_INTERPRET=1) multiplies bf16 dot operands as their raw uint16
# bits; under it, bf16 dots upcast to fp32 first (exact, as a tensor core's products are).
_INTERPRETER_BF16_FIX = tl.constexpr(type(tl.sum).__name__ == "InterpretedFunction")


@triton.jit
def _dot(a, b, acc):
    # fp32 operands: exact products and fp32 sums (no tf32 rounding); fp16/bf16: tensor cores
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    if _INTERPRETER_BF16_FIX:
        if a.dtype == tl.bfloat16:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _moe_gemm_kernel(
    A,
    W,
    Bias,
    RouterW,
    Out,
    SORTED_PAIRS,
    BLOCK_EXPERTS,
    NUM_PADDED,
    max_padded,
    num_pairs,
    top_k,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    alpha,
    limit,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # 1. this program's pairs (their A rows and expert) and output columns (`_moe_tile`)
    pid_m, pairs, pair_mask, rows, expert, offs_n, n_mask, offs_k, a_ptrs = _moe_tile(
        A, SORTED_PAIRS, BLOCK_EXPERTS, max_padded, num_pairs, top_k, N, stride_am, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    # 2. blocks past the experts' padded runs have nothing to do
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return
    # 3. the expert's weight tile
    w_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] of W[e].T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 4. march over K; gated: the up rows sit N rows below the gate rows of the same expert
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot(a, w, acc)
        if ACTIVATION != "none":
            u = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = _dot(a, u, acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # 5. epilogue: bias, rounded to the activation dtype as the reference's linear output is
    if HAS_BIAS:
        b_ptrs = Bias + expert * stride_be + offs_n
        acc += tl.load(b_ptrs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION != "none":
            acc_up += tl.load(b_ptrs + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(Out.dtype.element_ty).to(tl.float32)
    # 6. gate_up: the activation; down: the router weight of each pair
    if ACTIVATION != "none":
        y = _activate(y, acc_up.to(Out.dtype.element_ty).to(tl.float32), alpha, limit, ACTIVATION)
    if ROUTED:
        y *= tl.load(RouterW + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    # 7. store each pair's row at its pair index
    out_ptrs = Out + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(Out.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


# -- tuning ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEConfig:
    """One launch shape of the grouped GEMM."""

    block_m: int  # pairs per block: each expert's run is padded to a multiple of it
    block_n: int
    block_k: int
    group_m: int  # pair blocks side by side in the launch order (L2 reuse of weight tiles)
    num_warps: int
    num_stages: int

    def for_fp32(self) -> MoEConfig:
        """fp32 operands: on CUDA FMA dots (operands and two accumulators in registers) on 4-byte
        elements, so tiles of at most 64 x 32 x 32 (64 x 64 spilled on sm_80); on CDNA fp32 MFMAs
        (exact, not xf32)."""
        return replace(self, block_m=min(self.block_m, 64), block_n=min(self.block_n, 32),
                       block_k=min(self.block_k, 32))  # fmt: skip


@dataclass(frozen=True)
class FusedMoETuning:
    """Launch shapes for one architecture family, by tokens per launch: a decode shape up to
    `decode_tokens` tokens and a prefill shape above it, for both GEMMs.
    - pre-Hopper (the mapping runs it on sm_80..sm_89; below sm_80 Triton's dots are FMAs and the
      layer takes torch): 16 x 64 x 64 tiles (decode), 64 x 64 x 32 grouped by 8 (prefill), 4 warps,
      3 stages, mma.sync;
    - Hopper and later (sm_90+): at least 64 rows so the dots run on wgmma (below that Triton falls
      back to mma.sync): 64 x 64 x 64 over 4 stages (decode), 128 x 64 x 64 over 8 warps and 4
      stages (prefill), within sm_90's shared memory and under sm_120's 99 KiB, which shares it;
    - ROCm (64-lane wavefronts, 64 KiB of LDS): 16 x 64 x 64 and 64 x 64 x 64, 2 stages.
    Shared memory and registers per tuning: docs/benchmarks.md "Preflight matrix"."""

    name: str
    decode: MoEConfig
    prefill: MoEConfig
    decode_tokens: int = 32  # launches of at most this many tokens take the decode shape

    def launch_shape(self, tokens: int, dtype: str) -> MoEConfig:
        """The shape of both GEMMs of a launch over `tokens` tokens of Triton dtype `dtype`."""
        config = self.decode if tokens <= self.decode_tokens else self.prefill
        return config.for_fp32() if dtype == "fp32" else config


PRE_HOPPER = FusedMoETuning("sm70", MoEConfig(16, 64, 64, 1, 4, 3), MoEConfig(64, 64, 32, 8, 4, 3))
HOPPER = FusedMoETuning("sm90", MoEConfig(64, 64, 64, 1, 4, 4), MoEConfig(128, 64, 64, 8, 8, 4))
ROCM = FusedMoETuning("rocm", MoEConfig(16, 64, 64, 1, 4, 2), MoEConfig(64, 64, 64, 8, 4, 2))
TUNINGS = {t.name: t for t in (PRE_HOPPER, HOPPER, ROCM)}

# Kernels made while TRITON_INTERPRET=1 run on CPU tensors (tests); others need a GPU.
_INTERPRETED = type(_moe_gemm_kernel).__name__ == "InterpretedFunction"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a launch on `x` runs the kernel (GPU tensor, or the interpreter on CPU)."""
    return x.is_cuda or _INTERPRETED


# -- the wrapper -------------------------------------------------------------------------------


def gemm_ints(hidden: int, intermediate: int, gate_up: bool) -> tuple[tuple[str, int], ...]:
    """(name, value) of the integer arguments N .. stride_om of one GEMM over contiguous
    weights: what the wrapper passes and what `compile_specs` types."""
    h, i = hidden, intermediate
    if gate_up:  # x [T, H] @ w_gate_up[e].T [H, 2I] -> act [P, I]
        return ("N", i), ("K", h), ("stride_am", h), ("stride_we", 2 * i * h), ("stride_wn", h), \
            ("stride_be", 2 * i), ("stride_om", i)  # fmt: skip
    # act [P, I] @ w_down[e].T [I, H] -> [P, H]
    return ("N", h), ("K", i), ("stride_am", i), ("stride_we", h * i), ("stride_wn", i), ("stride_be", h), \
        ("stride_om", h)  # fmt: skip


def _check(x, w_gate_up, w_down, topk_ids, topk_weights, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"Unknown expert activation `{activation}`. Supported: {', '.join(ACTIVATIONS)}")
    if x.dtype not in _TRITON_DTYPES or {w_gate_up.dtype, w_down.dtype} != {x.dtype}:
        raise TypeError(f"Fused MoE needs x and both weights in one dtype of "
                        f"{', '.join(map(str, _TRITON_DTYPES))}; got `{x.dtype}`, `{w_gate_up.dtype}`, "
                        f"`{w_down.dtype}`")  # fmt: skip
    t, h = x.shape
    e, two_i, _ = w_gate_up.shape
    if w_gate_up.shape[2] != h or two_i % 2 or w_down.shape != (e, h, two_i // 2):
        raise ValueError(f"Expert weights must be w_gate_up [E, 2I, {h}] and w_down [E, {h}, I]; got "
                         f"`{tuple(w_gate_up.shape)}` and `{tuple(w_down.shape)}`")  # fmt: skip
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids and topk_weights must both be [{t}, K]; got `{tuple(topk_ids.shape)}` and "
                         f"`{tuple(topk_weights.shape)}`")  # fmt: skip


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
              activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
              tuning: FusedMoETuning = PRE_HOPPER) -> torch.Tensor:  # fmt: skip
    """The experts of `x` [T, H] for `topk_ids` / `topk_weights` [T, K] -> [T, H] in x's dtype:
    two grouped GEMM launches; the torch path on CPU tensors.

    - gate_up (`activation` silu | swiglu_oai | gelu_tanh): A rows are the pairs' tokens
      (`pair // top_k`); two accumulators (gate rows `n`, up rows `I + n` of `w_gate_up`), the bias,
      and the activated `[P, I]` rows written.
    - down (`ACTIVATION` none, `ROUTED`): A rows are the pairs' activated rows; the bias and the
      router weight in the epilogue, and the `[T, K, H]` result summed over top-k in torch.
    Accumulation is fp32; fp32 operands use `input_precision="ieee"` (never tf32), fp16/bf16 the
    tensor cores. Each matmul's output is rounded to the activation dtype before what follows it
    (as `F.linear` does in the reference), so low-precision results stay close."""
    _check(x, w_gate_up, w_down, topk_ids, topk_weights, activation)
    if not runs_triton(x) or x.shape[0] == 0:
        return fused_moe_torch(x, w_gate_up, w_down, topk_ids, topk_weights, b_gate_up, b_down, activation,
                                   alpha, limit)  # fmt: skip
    (t, h), (e, two_i, _), k = x.shape, w_gate_up.shape, topk_ids.shape[1]
    p, i = t * k, two_i // 2
    cfg = tuning.launch_shape(t, _TRITON_DTYPES[x.dtype])
    # 1. pairs sorted by expert, each expert's run padded to whole blocks
    sorted_pairs, block_experts, num_padded = align_pairs(topk_ids, e, cfg.block_m)
    max_padded = sorted_pairs.numel()
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    router = topk_weights.to(x.dtype).flatten().contiguous()  # [P] rounded to x's dtype, as the reference
    act = torch.empty((p, i), dtype=x.dtype, device=x.device)  # [P, I]
    out = torch.empty((p, h), dtype=x.dtype, device=x.device)  # [P, H]
    # 2. gate_up with the activation fused, then down with bias and router weights
    for a, w, bias, y, gate_up in ((x, w_gate_up, b_gate_up, act, True), (act, w_down, b_down, out, False)):
        ints = dict(gemm_ints(h, i, gate_up))
        grid = (max_padded // cfg.block_m * triton.cdiv(ints["N"], cfg.block_n),)
        _moe_gemm_kernel[grid](
            a, w, w if bias is None else bias.contiguous(), router, y, sorted_pairs, block_experts, num_padded,
            max_padded, p, k if gate_up else 1, *ints.values(), float(alpha), float(limit),
            ACTIVATION=activation if gate_up else "none", HAS_BIAS=bias is not None, ROUTED=not gate_up,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    # 3. the sum over each token's K experts
    return out.view(t, k, h).sum(dim=1) if k > 1 else out


def compile_specs(tuning: FusedMoETuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch `fused_moe` makes with `tuning`: per token bucket, gate_up for each
    activation and down, with and without biases. MoE sizes come from the workload's widths:
    hidden H and intermediate I each range over them (every pair, typed by divisibility as
    the JIT does); the expert count and top-k are runtime values no launch specializes on,
    so `Workload` needs no field of its own."""
    t = pointer(workload.dtype)
    index = pointer("i32")
    dims = dict.fromkeys((*(int_arg(v) for _, v in gemm_ints(h, i, gate_up)), gate_up)
                         for h in workload.widths for i in workload.widths for gate_up in (True, False))  # fmt: skip
    specs = []
    for m in workload.token_counts():
        cfg = tuning.launch_shape(m, workload.dtype)
        blocks = (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n), ("BLOCK_K", cfg.block_k),
                  ("GROUP_M", cfg.group_m))  # fmt: skip
        for *types, gate_up in dims:
            names = [n for n, _ in gemm_ints(1, 1, gate_up)]
            args = (("A", t), ("W", t), ("Bias", t), ("RouterW", t), ("Out", t), ("SORTED_PAIRS", index),
                    ("BLOCK_EXPERTS", index), ("NUM_PADDED", index), *((n, "i32") for n in _UNSPECIALIZED),
                    *zip(names, types, strict=True), ("alpha", "fp32"), ("limit", "fp32"))  # fmt: skip
            for has_bias in (False, True):
                for activation in ACTIVATIONS if gate_up else ("none",):
                    constexprs = (("ACTIVATION", activation), ("HAS_BIAS", has_bias), ("ROUTED", not gate_up),
                                  *blocks)  # fmt: skip
                    specs.append(CompileSpec(_moe_gemm_kernel, args, constexprs, cfg.num_warps, cfg.num_stages,
                                             dot=None if workload.dtype == "fp32" else "f16"))  # fmt: skip
    return unique(specs)
