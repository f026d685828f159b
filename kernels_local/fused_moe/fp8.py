"""Fused mixture-of-experts over a pre-quantized checkpoint's fp8 experts: the grouped GEMM with e4m3
weights (weight-only or native), its torch references, and the launches the preflight compiles.

`_moe_fp8_gemm_kernel` is the grouped GEMM of `fused_moe.py` with each K tile's dot scaled, before
it is added, by its weight group's scale (and, native, by its rows' activation scales), so
per-tensor, per-channel and 128 x 128 block scales all run in one kernel (BLOCK_K divides 128: a
K tile never straddles a scale group). `NATIVE=False` (weight-only, sm_80..sm_88 and ROCm without
fp8 matrix cores) decodes the bytes in registers into the activations' dtype (exact) for the
16-bit tensor cores and never quantizes the activations; `NATIVE=True` (sm_89+, CDNA3 in
e4m3fnuz, CDNA4) quantizes A to fp8 before each GEMM and runs the dot on the fp8 tensor cores.
The trade-off: the scales are applied per K tile (one multiply per tile and row block) rather than
once in the epilogue, which costs little and lets block scales share the kernel (`fused_moe_fp8`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

from .fused_moe import (
    _INTERPRETER_BF16_FIX,
    _TRITON_DTYPES,
    FusedMoETuning,
    _activate,
    _moe_tile,
    align_pairs,
    gemm_ints,
    runs_triton,
)
from .torch_path import expert_activation

FP8_DTYPES = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
MAX_VALUES = {"e4m3fn": 448.0, "e4m3fnuz": 240.0}
GROUP = 128  # columns per activation scale with block weights
_UNSPECIALIZED = ("max_padded", "num_pairs", "top_k", "stride_sa", "group_n", "group_k", "act_group")


@triton.jit
def _decode_e4m3(q, FNUZ: tl.constexpr):
    # e4m3 bytes -> fp32 values, exact: sign, re-biased exponent and mantissa put into fp32 bits;
    # subnormals as mantissa times the smallest spacing
    b = q.to(tl.uint32)
    sign = b >> 7
    exp = (b >> 3) & 0xF
    man = b & 0x7
    if FNUZ:
        bias = 8
        sub_step = 0.0009765625  # 2**-10
    else:
        bias = 7
        sub_step = 0.001953125  # 2**-9
    normal = ((sign << 31) | ((exp + (127 - bias)) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * sub_step * (1.0 - 2.0 * sign.to(tl.float32))
    return tl.where(exp == 0, sub, normal)


@triton.jit
def _load_weight(ptrs, mask, dtype: tl.constexpr, NATIVE: tl.constexpr, FNUZ: tl.constexpr):
    # native: the fp8 operand as stored; weight-only: the bytes decoded into the activations' dtype
    if NATIVE:
        w = tl.load(ptrs, mask=mask, other=0.0)
    else:
        w = _decode_e4m3(tl.load(ptrs, mask=mask, other=0), FNUZ).to(dtype)
    return w


@triton.jit
def _dot_any(a, b):
    # fp8 x fp8 on the fp8 tensor cores; fp32 operands exact (ieee); fp16/bf16 on the 16-bit ones
    zero = tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32)
    if a.dtype == tl.float32:
        return tl.dot(a, b, zero, input_precision="ieee")
    if _INTERPRETER_BF16_FIX:
        if a.dtype == tl.bfloat16:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), zero, input_precision="ieee")
    return tl.dot(a, b, zero)


@triton.jit(do_not_specialize=(*_UNSPECIALIZED, "stride_se", "stride_sn"))
def _moe_fp8_gemm_kernel(
    A,
    SA,
    W,
    SW,
    Bias,
    RouterW,
    Out,
    SORTED_PAIRS,
    BLOCK_EXPERTS,
    NUM_PADDED,
    max_padded,
    num_pairs,
    top_k,
    stride_sa,
    group_n,
    group_k,
    act_group,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    stride_se,
    stride_sn,
    alpha,
    limit,
    NATIVE: tl.constexpr,
    FNUZ: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # 1. this program's pairs (their A rows and expert) and output columns (kernels_local/expert_pairs.py `_moe_tile`)
    pid_m, pairs, pair_mask, rows, expert, offs_n, n_mask, offs_k, a_ptrs = _moe_tile(
        A, SORTED_PAIRS, BLOCK_EXPERTS, max_padded, num_pairs, top_k, N, stride_am, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    # 2. blocks past the experts' padded runs have nothing to do
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return
    # 3. the expert's weight tile and the weight rows' scale rows
    w_ptrs = W + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] of W[e].T
    s_gate = SW + expert * stride_se + (offs_n // group_n) * stride_sn  # [BLOCK_N]
    s_up = SW + expert * stride_se + ((N + offs_n) // group_n) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # 4. march over K: each tile's dot scaled by its weight group (and activation group) scales
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        scale_a = 1.0
        if NATIVE:
            scale_a = tl.load(SA + rows * stride_sa + k0 // act_group, mask=pair_mask, other=0.0)[:, None]
        w = _load_weight(w_ptrs, k_mask[:, None] & n_mask[None, :], a.dtype, NATIVE, FNUZ)
        sw = tl.load(s_gate + k0 // group_k, mask=n_mask, other=0.0)
        acc += _dot_any(a, w) * sw[None, :] * scale_a
        if ACTIVATION != "none":
            u = _load_weight(w_ptrs + N * stride_wn, k_mask[:, None] & n_mask[None, :], a.dtype, NATIVE, FNUZ)
            su = tl.load(s_up + k0 // group_k, mask=n_mask, other=0.0)
            acc_up += _dot_any(a, u) * su[None, :] * scale_a
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # 5. epilogue: bias, rounded to the output dtype as the reference's linear output is
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


# -- torch: activations onto the grid, experts dequantized ------------------------------------------


def quantize_activations(x: torch.Tensor, activations: str, fmt: str, input_scale: torch.Tensor | None = None):
    """x [M, K] -> (fp8 values [M, K], fp32 scales [M, G]): per token (G = 1), per token and 128
    columns (G = ceil(K / 128)), or with the static scale (G = 1). Rounded once, from fp32."""
    x32, top = x.to(torch.float32), MAX_VALUES[fmt]
    tiny = torch.finfo(torch.float32).tiny
    if activations == "static_tensor":
        scale = input_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1).contiguous()
        return (x32 / scale).clamp(-top, top).to(FP8_DTYPES[fmt]), scale
    if activations == "dynamic_token":
        scale = (x32.abs().amax(dim=-1, keepdim=True) / top).clamp(min=tiny)  # [M, 1]
        return (x32 / scale).clamp(-top, top).to(FP8_DTYPES[fmt]), scale
    m, k = x.shape
    groups = -(-k // GROUP)
    g = F.pad(x32, (0, groups * GROUP - k)).reshape(m, groups, GROUP)  # [M, G, 128]
    scale = (g.abs().amax(dim=-1) / top).clamp(min=tiny)  # [M, G]
    q = (g / scale[..., None]).clamp(-top, top).to(FP8_DTYPES[fmt]).reshape(m, groups * GROUP)[:, :k]
    return q.contiguous(), scale


def dequantize_expert(q: torch.Tensor, scale: torch.Tensor, groups: tuple[int, int], fmt: str) -> torch.Tensor:
    """One expert's weight [N, K] in fp32: each byte's value (uint8 read as `fmt`, or fp8) times its scale."""
    n, k = q.shape
    gn, gk = groups
    values = (q.view(FP8_DTYPES[fmt]) if q.dtype == torch.uint8 else q).to(torch.float32)
    s = scale.to(torch.float32)
    s = s.repeat_interleave(gn, dim=0) if gn > 1 else s
    s = s.repeat_interleave(gk, dim=1) if gk < k else s
    return values * s[:n, :k]


def _activation_group(activations: str) -> int | None:
    return GROUP if activations == "dynamic_group" else None


def _expert_linear(x, q, scale, groups, bias, experts, input_scale):
    """One expert's projection of rows `x` as its execution computes it, in x's dtype."""
    w = dequantize_expert(q, scale, groups, experts.fp8_fmt)  # [N, K] fp32
    if experts.execution != "native":  # weight-only: the dequantized weight in x's dtype, x's own matmul
        return F.linear(x, w.to(x.dtype), bias)
    grid, sx = quantize_activations(x, experts.activations, experts.fp8_fmt, input_scale)
    group = _activation_group(experts.activations)
    a = grid.to(torch.float32) * (sx if group is None else sx.repeat_interleave(group, dim=1)[:, : x.shape[1]])
    y = a @ w.t()
    return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)


def fused_moe_fp8_reference(x: torch.Tensor, experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                            row_tile: int | None = None) -> torch.Tensor:  # fmt: skip
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) -> [T, H] in x's dtype, each expert's weights
    dequantized as its execution reads them (see `fused_moe_reference` for the grouping)."""
    k = topk_ids.shape[1]
    flat = topk_ids.flatten()  # [P]
    order = flat.argsort(stable=True)
    tokens = order // k  # [P]
    xs = x.index_select(0, tokens)  # [P, H]
    ys = torch.empty_like(xs)
    inp = experts.input_scales or (None, None)
    b1, b2 = getattr(experts, "b_gate_up", None), getattr(experts, "b_down", None)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=experts.w_gate_up_q.shape[0]).tolist()):
        tile = row_tile or n
        for lo in range(start, start + n, max(tile, 1)):
            rows = min(tile, start + n - lo)
            part = xs[lo : lo + rows] if rows == tile else F.pad(xs[lo : lo + rows], (0, 0, 0, tile - rows))
            h = _expert_linear(part, experts.w_gate_up_q[e], experts.w_gate_up_scale[e], experts.gate_up_groups,
                               None if b1 is None else b1[e], experts, inp[0])  # [tile, 2I]
            a = expert_activation(h, experts.activation, experts.alpha, experts.limit)
            y = _expert_linear(a, experts.w_down_q[e], experts.w_down_scale[e], experts.down_groups,
                               None if b2 is None else b2[e], experts, inp[1])  # [tile, H]
            ys[lo : lo + rows] = y[:rows]
        start += n
    ys = ys * topk_weights.flatten().index_select(0, order)[:, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, ys)  # [T, H]


# -- the wrapper -----------------------------------------------------------------------------------


def _check(experts, native: bool) -> None:
    want = FP8_DTYPES[experts.fp8_fmt] if native else torch.uint8
    got = {experts.w_gate_up_q.dtype, experts.w_down_q.dtype}
    if got != {want}:
        raise TypeError(f"fp8 experts for the `{'native' if native else 'weight_only'}` execution store `{want}`; "
                        f"got `{', '.join(sorted(map(str, got)))}`")  # fmt: skip


def launch_shape(tuning: FusedMoETuning, tokens: int, dtype: str):
    """The tuning's shape for `tokens`, with K tiles of at most 64 (they divide a 128-column group)
    and, for tiles of 64 rows or more, at most 32 columns: each K tile's dot is scaled before it is
    added, so gate and up each hold a dot result beside their accumulator, which at 64 x 64 spilled
    (sm_80 weight-only; sm_90 and sm_120 native)."""
    cfg = tuning.launch_shape(tokens, dtype)
    cfg = cfg if cfg.block_k <= 64 else replace(cfg, block_k=64)
    return cfg if cfg.block_m < 64 else replace(cfg, block_n=min(cfg.block_n, 32))


def fused_moe_fp8(x: torch.Tensor, experts, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, native: bool,
                  tuning: FusedMoETuning) -> torch.Tensor:  # fmt: skip
    """The fp8 experts of `x` [T, H] -> [T, H] in x's dtype: two launches of the grouped GEMM (native
    fp8 operands or weight-only), the torch reference on CPU tensors.

    `experts` (the model's `Fp8FusedMoE`) carries them as the checkpoint stored them, stacked, in one
    scale layout for every scheme: `w_gate_up_q` [E, 2I, H] and `w_down_q` [E, H, I] e4m3 bytes (an
    fp8 tensor when native, uint8 storage when weight-only), `w_gate_up_scale` [E, ceil(2I / gn),
    ceil(H / gk)] and `w_down_scale` [E, ceil(H / gn), ceil(I / gk)] fp32, weight (e, n, k) being
    `q[e, n, k] * scale[e, n // gn, k // gk]` (per-tensor and per-channel: one value per row, gk = K;
    128 x 128 blocks: gn = gk = 128, or gn = 1 where gate and up did not start on a block); it also
    names `gate_up_groups`, `down_groups`, `activations` ("dynamic_token" | "dynamic_group" |
    "static_tensor"), `input_scales` (the two static scales, or None), `fp8_fmt` and `execution`.
    Native activations are quantized per token, per token and 128 columns, or with the static scale:
    the largest of the experts' stored `input_scale`s, as vLLM takes it, so no expert's inputs
    saturate."""
    _check(experts, native)
    if not runs_triton(x) or x.shape[0] == 0:
        return fused_moe_fp8_reference(x, experts, topk_ids, topk_weights)
    (t, h), (e, two_i, _), k = x.shape, experts.w_gate_up_q.shape, topk_ids.shape[1]
    p, i = t * k, two_i // 2
    cfg = launch_shape(tuning, t, "fp8" if native else _TRITON_DTYPES[x.dtype])
    # 1. pairs sorted by expert, each expert's run padded to whole blocks
    sorted_pairs, block_experts, num_padded = align_pairs(topk_ids, e, cfg.block_m)
    max_padded = sorted_pairs.numel()
    router = topk_weights.to(x.dtype).flatten().contiguous()
    act = torch.empty((p, i), dtype=x.dtype, device=x.device)  # [P, I]
    out = torch.empty((p, h), dtype=x.dtype, device=x.device)  # [P, H]
    inp = experts.input_scales or (None, None)
    b1, b2 = getattr(experts, "b_gate_up", None), getattr(experts, "b_down", None)
    steps = ((x.contiguous(), experts.w_gate_up_q, experts.w_gate_up_scale, experts.gate_up_groups, b1, act, True,
              inp[0]),
             (act, experts.w_down_q, experts.w_down_scale, experts.down_groups, b2, out, False, inp[1]))  # fmt: skip
    # 2. gate_up with the activation fused, then down with bias and router weights
    for a, w, s, (gn, gk), bias, y, gate_up, static in steps:
        a_in, sa = (quantize_activations(a, experts.activations, experts.fp8_fmt, static) if native
                    else (a, a))  # fmt: skip
        ints = dict(gemm_ints(h, i, gate_up))
        act_group = GROUP if experts.activations == "dynamic_group" else ints["K"]
        grid = (max_padded // cfg.block_m * triton.cdiv(ints["N"], cfg.block_n),)
        _moe_fp8_gemm_kernel[grid](
            a_in, sa, w, s, y if bias is None else bias.contiguous(), router, y, sorted_pairs, block_experts,
            num_padded, max_padded, p, k if gate_up else 1, sa.stride(0), gn, gk, act_group, *ints.values(),
            s.stride(0), s.stride(1), float(experts.alpha), float(experts.limit), NATIVE=native,
            FNUZ=experts.fp8_fmt == "e4m3fnuz", ACTIVATION=experts.activation if gate_up else "none",
            HAS_BIAS=bias is not None, ROUTED=not gate_up, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    # 3. the sum over each token's K experts
    return out.view(t, k, h).sum(dim=1) if k > 1 else out


# -- ahead-of-time compile specs -------------------------------------------------------------------


def fp8_compile_specs(tuning: FusedMoETuning, workload: Workload, *, native: bool) -> tuple[CompileSpec, ...]:
    """Every launch `fused_moe_fp8` makes with `tuning`: per token bucket, gate_up for each activation
    and down, with and without biases, on fp8 operands (native) or 16-bit ones with uint8 weights."""
    t, index = pointer(workload.dtype), pointer("i32")
    a = pointer(workload.fp8_type) if native else t
    w = pointer(workload.fp8_type) if native else pointer("u8")
    dims = dict.fromkeys((*(int_arg(v) for _, v in gemm_ints(h, i, gate_up)), gate_up)
                         for h in workload.widths for i in workload.widths for gate_up in (True, False))  # fmt: skip
    specs = []
    for m in workload.token_counts():
        cfg = launch_shape(tuning, m, "fp8" if native else workload.dtype)
        blocks = (("BLOCK_M", cfg.block_m), ("BLOCK_N", cfg.block_n), ("BLOCK_K", cfg.block_k),
                  ("GROUP_M", cfg.group_m))  # fmt: skip
        for *types, gate_up in dims:
            names = [n for n, _ in gemm_ints(1, 1, gate_up)]
            args = (("A", a), ("SA", pointer("fp32") if native else a), ("W", w), ("SW", pointer("fp32")),
                    ("Bias", t), ("RouterW", t), ("Out", t), ("SORTED_PAIRS", index), ("BLOCK_EXPERTS", index),
                    ("NUM_PADDED", index), *((n, "i32") for n in _UNSPECIALIZED), *zip(names, types, strict=True),
                    ("stride_se", "i32"), ("stride_sn", "i32"), ("alpha", "fp32"), ("limit", "fp32"))  # fmt: skip
            for has_bias in (False, True):
                for activation in ("silu", "swiglu_oai", "gelu_tanh") if gate_up else ("none",):
                    constexprs = (("NATIVE", native), ("FNUZ", workload.fp8_fmt == "e4m3fnuz"),
                                  ("ACTIVATION", activation), ("HAS_BIAS", has_bias), ("ROUTED", not gate_up),
                                  *blocks)  # fmt: skip
                    dot = "fp8" if native else (None if workload.dtype == "fp32" else "f16")
                    specs.append(CompileSpec(_moe_fp8_gemm_kernel, args, constexprs, cfg.num_warps, cfg.num_stages,
                                             dot=dot))  # fmt: skip
    return unique(specs)
