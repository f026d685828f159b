"""`Fp8FusedMoE`: a checkpoint's fp8 experts, stacked as stored, run the device's way.

Design: the experts of one layer as `FusedMoE` holds them (`w_gate_up` [E, 2I, H], `w_down`
[E, H, I]), but as the checkpoint's e4m3 bytes with their scales in `e4m3`'s grouped layout per
expert and, where the scheme has them, one static input scale per projection (the largest of the
experts', as vLLM takes it, so no expert's inputs saturate). The loader never converts a value;
the fp8 step's `prepare(kind, fmt)` gives it the device's `Fp8Execution`, as for
`Fp8CheckpointLinear`. It is kernel-swappable (kernels_local/fused_moe); `forward` is the torch
reference of its execution through `run_experts`, the expert loop both quantized expert layers
share, which computes as the model's `FusedMoE` does. Trade-off: the reference (a simulated GPU's
CPU path) dequantizes an active expert's weights on every call: time, never memory held."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels import use_kernel_forward_from_hub
from torch import nn

from workers.contract import FP8_DEQUANTIZED, FP8_EXECUTIONS, FP8_NATIVE, FP8_WEIGHT_ONLY
from workers.quant.e4m3 import (
    FP8_DTYPES,
    dequantize_activations,
    dequantize_weight,
    fn_to_fnuz,
    quantize_activations,
)
from workers.quant.linear import STORED, Fp8LayerStateError, _nbytes
from workers.quant.scheme import Fp8Scheme

ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")


def expert_activation(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] gate columns then up columns -> [n, I] (as workers/model/moe.py's experts)."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def run_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                row_tile: int | None, expert) -> torch.Tensor:
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with `expert(e, rows [n, H]) -> [n, H]`: the token-expert
    pairs grouped by one stable sort, each expert's rows in one call (in tiles of `row_tile`, the last
    zero-padded, when set), experts added in ascending order. x [T, H], topk_ids / topk_weights [T, K]."""
    k = topk_ids.shape[1]
    flat = topk_ids.flatten()  # [P]
    order = flat.argsort(stable=True)  # pairs grouped by expert, tokens ascending within each
    tokens = order // k
    xs = x.index_select(0, tokens)  # [P, H]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        tile = row_tile or n
        for lo in range(start, start + n, max(tile, 1)):  # nothing for an expert without pairs
            rows = min(tile, start + n - lo)
            part = xs[lo : lo + rows] if rows == tile else F.pad(xs[lo : lo + rows], (0, 0, 0, tile - rows))
            ys[lo : lo + rows] = expert(e, part)[:rows]  # [tile, H]
        start += n
    ys = ys * topk_weights.flatten().index_select(0, order)[:, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, ys)  # [T, H]


@use_kernel_forward_from_hub("Fp8FusedMoE")
class Fp8FusedMoE(nn.Module):
    """The fp8 experts of one layer. `forward(x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H]`.

    Kernel layers read `execution`, `fp8_fmt`, `w_gate_up_q`, `w_down_q` (fp8 when native, uint8 when
    weight-only, None when dequantized), `w_gate_up_scale`, `w_down_scale`, `gate_up_groups`,
    `down_groups`, `activations`, `input_scales` (None, or the two static scales), `w_gate_up`,
    `w_down` (dequantized only), `b_gate_up`, `b_down`, `activation`, `alpha`, `limit`, `row_tile`."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, scheme: Fp8Scheme,
                 gate_up_groups: tuple[int, int], down_groups: tuple[int, int], bias: bool = False,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta") -> None:  # fmt: skip
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"Unknown expert activation `{activation}`. Supported: {', '.join(ACTIVATIONS)}")
        e, h, i = num_experts, hidden, intermediate
        self.num_experts, self.activation, self.alpha, self.limit = e, activation, alpha, limit
        self.scheme, self.activations = scheme, scheme.activations
        self.gate_up_groups, self.down_groups = tuple(gate_up_groups), tuple(down_groups)
        self.execution, self.fp8_fmt, self.compute_dtype = STORED, "e4m3fn", dtype
        self.row_tile: int | None = None  # deterministic mode: each expert's rows in fixed tiles
        for name, (n, k), (gn, gk) in (("w_gate_up", (2 * i, h), gate_up_groups), ("w_down", (h, i), down_groups)):
            self.register_buffer(f"{name}_q", torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device))
            self.register_buffer(f"{name}_scale", torch.empty(e, -(-n // gn), -(-k // gk), dtype=torch.float32,
                                                              device=device))  # fmt: skip
            self.register_buffer(name, None)
        static = scheme.activations == "static_tensor"
        self.register_buffer("input_scale", torch.empty(2, dtype=torch.float32, device=device) if static else None)
        self.b_gate_up = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype, device=device)) if bias else None
        self.b_down = nn.Parameter(torch.empty(e, h, dtype=dtype, device=device)) if bias else None

    @property
    def input_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The static input scales of the gate_up and down projections (0-d each), or None."""
        return None if self.input_scale is None else (self.input_scale[0], self.input_scale[1])

    # -- the fp8 step ---------------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self, kind: str, fmt: str) -> None:
        """Turn the stored bytes into execution `kind` in e4m3 flavour `fmt` (see the module docstring)."""
        if self.execution != STORED:
            raise Fp8LayerStateError(f"fp8 experts already prepared for `{self.execution}`; refusing `{kind}`")
        if kind not in FP8_EXECUTIONS:
            raise ValueError(f"Unknown fp8 execution `{kind}`. Supported: {', '.join(FP8_EXECUTIONS)}")
        for name, groups in (("w_gate_up", self.gate_up_groups), ("w_down", self.down_groups)):
            q, scale = getattr(self, f"{name}_q"), getattr(self, f"{name}_scale")
            # 1. CDNA3: the same bytes read as e4m3fnuz are half the value; -0 (its NaN) becomes 0
            if fmt == "e4m3fnuz":
                q, scale = fn_to_fnuz(q), scale * 2
            # 2. the buffers of the execution: fp8 operands, uint8 storage, or the widened weights
            if kind == FP8_DEQUANTIZED:
                w = torch.stack([dequantize_weight(q[e], scale[e], *groups, fmt) for e in range(q.shape[0])])
                setattr(self, name, w.to(self.compute_dtype))
                setattr(self, f"{name}_q", None)
            else:
                setattr(self, f"{name}_q", q.view(FP8_DTYPES[fmt] if kind == FP8_NATIVE else torch.uint8))
            setattr(self, f"{name}_scale", scale)
        if self.input_scale is not None and fmt == "e4m3fnuz":
            self.input_scale = self.input_scale * 2
        self.execution, self.fp8_fmt = kind, fmt

    def nbytes(self) -> int:
        """Bytes the experts' weights take now: fp8 bytes and scales, or the widened weights."""
        return _nbytes(self.w_gate_up_q, self.w_gate_up_scale, self.w_down_q, self.w_down_scale, self.input_scale,
                       self.w_gate_up, self.w_down)  # fmt: skip

    # -- the reference forward --------------------------------------------------------------------

    def _linear(self, x: torch.Tensor, name: str, e: int, groups, bias, static) -> torch.Tensor:
        """Expert `e`'s projection `name` of rows `x` [n, K] as the execution computes it, in x's dtype."""
        if self.execution == FP8_DEQUANTIZED:
            return F.linear(x, getattr(self, name)[e], bias)
        w = dequantize_weight(getattr(self, f"{name}_q")[e], getattr(self, f"{name}_scale")[e], *groups, self.fp8_fmt)
        if self.execution == FP8_WEIGHT_ONLY:
            return F.linear(x, w.to(x.dtype), bias)
        group = 128 if self.activations == "dynamic_group" else None
        grid, sx = quantize_activations(x, self.activations, self.fp8_fmt, static, group)
        y = dequantize_activations(grid, sx, group) @ w.t()  # [n, N] fp32
        return (y if bias is None else y + bias.to(torch.float32)).to(x.dtype)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # x [T, H], topk_ids / topk_weights [T, K] -> [T, H]
        if self.execution == STORED:
            raise Fp8LayerStateError("fp8 experts used before the fp8 step prepared them for their device")
        static = self.input_scales or (None, None)

        def expert(e: int, part: torch.Tensor) -> torch.Tensor:
            h = self._linear(part, "w_gate_up", e, self.gate_up_groups,
                             None if self.b_gate_up is None else self.b_gate_up[e], static[0])  # [tile, 2I]
            act = expert_activation(h, self.activation, self.alpha, self.limit)
            return self._linear(act, "w_down", e, self.down_groups,
                                None if self.b_down is None else self.b_down[e], static[1])  # [tile, H]

        return run_experts(x, topk_ids, topk_weights, self.num_experts, self.row_tile, expert)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, scheme={self.scheme.weights}/{self.activations}, "
                f"groups={self.gate_up_groups}/{self.down_groups}, execution={self.execution}, fmt={self.fp8_fmt}")
