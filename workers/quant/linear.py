"""`Fp8CheckpointLinear`: a checkpoint's fp8 linear layer, its bytes and scales as stored, run the device's way.

Design: the loader fills the layer with what the checkpoint stores (`qweight` float8_e4m3fn
[N, K], fused parts concatenated; `weight_scale` in `e4m3`'s grouped layout; `input_scale` when
activations are static) and never converts a value. The fp8 step's `prepare(kind, fmt)` then
gives it the device's `Fp8Execution` (workers/contract/fp8_rule.py): `native` keeps fp8 operands
(e4m3fnuz with doubled scales on CDNA3) and quantizes activations as the scheme says,
`weight_only` keeps the bytes as uint8 for a 16-bit GEMM, `dequantized` widens the weight. `forward`
is the torch reference of that execution; the device's kernel layer refuses a layer prepared for
another. Trade-off: until the fp8 step a loaded layer cannot run (`Fp8LayerStateError`), so a model
is never served half prepared."""

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
from workers.quant.scheme import Fp8Scheme

STORED = "stored"  # loaded, not yet prepared for an execution


class Fp8LayerStateError(RuntimeError):
    """A checkpoint fp8 layer used before (or prepared twice for) its device's execution."""


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@use_kernel_forward_from_hub("Fp8CheckpointLinear")
class Fp8CheckpointLinear(nn.Module):
    """y = x @ W.T + b, W[n, k] = q[n, k] * weight_scale[n // group_n, k // group_k].

    Kernel layers read `execution`, `qweight` [N, K] (an fp8 dtype when native, uint8 when
    weight-only, None when dequantized), `weight` [N, K] (dequantized only), `weight_scale` fp32,
    `group_n`, `group_k`, `activations`, `act_group`, `input_scale` (0-d fp32 or None), `fp8_fmt`, `bias`."""

    def __init__(self, in_features: int, out_features: int, scheme: Fp8Scheme, scale_shape: tuple[int, int],
                 group_n: int, group_k: int, bias: bool = False, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "meta") -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.group_n, self.group_k = group_n, group_k
        self.activations, self.act_group = scheme.activations, scheme.act_group
        self.execution, self.fp8_fmt, self.compute_dtype = STORED, "e4m3fn", dtype
        n, k = out_features, in_features
        self.register_buffer("qweight", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_scale", torch.empty(scale_shape, dtype=torch.float32, device=device))
        static = scheme.activations == "static_tensor"
        self.register_buffer("input_scale", torch.empty((), dtype=torch.float32, device=device) if static else None)
        self.register_buffer("weight", None)
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype, device=device)) if bias else None

    # -- the fp8 step ---------------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self, kind: str, fmt: str) -> None:
        """Turn the stored bytes into execution `kind` in e4m3 flavour `fmt` (see the module docstring)."""
        if self.execution != STORED:
            raise Fp8LayerStateError(f"fp8 layer already prepared for `{self.execution}`; refusing `{kind}`")
        if kind not in FP8_EXECUTIONS:
            raise ValueError(f"Unknown fp8 execution `{kind}`. Supported: {', '.join(FP8_EXECUTIONS)}")
        if fmt not in FP8_DTYPES:
            raise ValueError(f"Unknown e4m3 format `{fmt}`. Supported: {', '.join(FP8_DTYPES)}")
        q, scale, inp = self.qweight, self.weight_scale, self.input_scale
        # 1. CDNA3: the same bytes read as e4m3fnuz are half the value; -0 (its NaN) becomes 0
        if fmt == "e4m3fnuz":
            q, scale = fn_to_fnuz(q), scale * 2
            inp = None if inp is None else inp * 2
        # 2. the buffers of the execution: fp8 operands, uint8 storage, or the widened weight
        if kind == FP8_NATIVE:
            self.qweight = q.view(FP8_DTYPES[fmt])
        elif kind == FP8_WEIGHT_ONLY:
            self.qweight = q.view(torch.uint8)
        else:
            self.weight = dequantize_weight(q, scale, self.group_n, self.group_k, fmt).to(self.compute_dtype)
            self.qweight = None
        self.weight_scale, self.input_scale = scale, inp
        self.execution, self.fp8_fmt = kind, fmt

    def nbytes(self) -> int:
        """Bytes this layer's weight takes now: fp8 bytes and scales, or the widened weight."""
        return _nbytes(self.qweight, self.weight_scale, self.input_scale, self.weight)

    # -- the reference forward --------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if self.execution == FP8_DEQUANTIZED:
            return F.linear(x, self.weight, self.bias)
        if self.execution == FP8_WEIGHT_ONLY:
            w = dequantize_weight(self.qweight, self.weight_scale, self.group_n, self.group_k, self.fp8_fmt)
            return F.linear(x, w.to(x.dtype), self.bias)
        if self.execution != FP8_NATIVE:
            raise Fp8LayerStateError("fp8 checkpoint layer used before the fp8 step prepared it for its device")
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        grid, sx = quantize_activations(x2, self.activations, self.fp8_fmt, self.input_scale, self.act_group)
        w = dequantize_weight(self.qweight, self.weight_scale, self.group_n, self.group_k, self.fp8_fmt)  # [N, K]
        y = dequantize_activations(grid, sx, self.act_group) @ w.t()  # [M, N] fp32
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme.weights}/{self.activations}, groups=({self.group_n}, {self.group_k}), "
                f"execution={self.execution}, fmt={self.fp8_fmt}")
