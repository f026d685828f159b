"""`Int4CheckpointLinear`: a 4-bit checkpoint's linear layer in the one run-time layout the W4A16 kernel reads.

Design: `to_runtime(scheme, stored)` moves any format's stored tensors into one layout, exactly
(only bits move): `qweight` int32 [ceil(K/8), N] packed along the inputs (GPTQ's own; AWQ's and
pack-quantized's words are repacked), `zeros` int8 [G, N] (the zero point each group subtracts,
the formats' offsets applied), `scales` [G, N] in the checkpoint's dtype and `g_idx` only for
act-order. The weight is `(q - z) * s` rounded once to the scales' dtype, the reference's bits.
The layer holds that layout for the packed executions (`w4a16`, `packed`) or the weight widened at
load (`dequantized`); the kernel layers refuse a module of another execution, and `forward` is the
torch reference they are tested against. Trade-off: a byte per zero point (per group and output)
so the kernel loads them without a second unpack."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels import use_kernel_forward_from_hub
from torch import nn

from workers.quant.int4_pack import pack_int32, unpack_int32
from workers.quant.int4_scheme import Int4Scheme


def to_runtime(scheme: Int4Scheme, stored: dict[str, torch.Tensor]) -> dict:
    """The run-time layout (`qweight`, `scales`, `zeros`, `g_idx`, `group_size`, `in_features`) of one layer's
    stored tensors (its leaves, `qweight`/`qzeros`/`scales`/`g_idx` or `weight_packed`/...)."""
    group = 0 if scheme.group_size == -1 else scheme.group_size
    if scheme.layout == "gptq":
        scales = stored["scales"]
        n = scales.shape[1]
        qweight, k = stored["qweight"], stored["qweight"].shape[0] * 8
        zeros = unpack_int32(stored["qzeros"], n, dim=1) + scheme.zero_offset  # [G, N]
        g_idx = stored.get("g_idx")
        if g_idx is not None:
            trivial = torch.arange(k, device=g_idx.device) // (group or k)  # on the tensors' device (a GPU's)
            g_idx = None if torch.equal(g_idx.to(torch.int64), trivial) else g_idx.to(torch.int32)
    elif scheme.layout == "awq":
        scales = stored["scales"]
        n, k = scales.shape[1], stored["qweight"].shape[0]
        q = unpack_int32(stored["qweight"], n, dim=1, awq_order=True)  # [K, N]
        qweight = pack_int32(q, dim=0)
        zeros, g_idx = unpack_int32(stored["qzeros"], n, dim=1, awq_order=True), None
    else:
        n, k = (int(v) for v in stored["weight_shape"].reshape(-1).tolist())
        q = unpack_int32(stored["weight_packed"], k, dim=1)  # [N, K], offset by 8
        qweight = pack_int32(q.t(), dim=0)
        scales = stored["weight_scale"].t().contiguous()  # [G, N]
        zp = stored.get("weight_zero_point")
        zeros = torch.full(scales.shape, 8, device=scales.device) if zp is None else unpack_int32(zp, n, dim=0).t()
        g_idx = None
    return {"qweight": qweight.contiguous(), "scales": scales.contiguous(), "zeros": zeros.to(torch.int8).contiguous(),
            "g_idx": g_idx, "group_size": group, "in_features": k}


def runtime_weight(qweight, scales, zeros, g_idx, group_size: int, in_features: int) -> torch.Tensor:
    """The weight [N, K] in the scales' dtype: (q - z) * s, the product exact in fp32, rounded once."""
    q = unpack_int32(qweight, in_features, dim=0)  # [K, N]
    groups, n = scales.shape
    size = group_size if group_size else in_features
    if g_idx is None and groups * size == in_features:  # whole groups: broadcast, no per-input gather
        diff = q.view(groups, size, n) - zeros.to(torch.int32)[:, None, :]  # [G, size, N]
        w = (diff.to(torch.float32) * scales.to(torch.float32)[:, None, :]).view(in_features, n)
        return w.to(scales.dtype).t()
    k = torch.arange(in_features, device=qweight.device)
    g = g_idx.long() if g_idx is not None else (k // group_size if group_size else k * 0)
    w = (q - zeros.to(torch.int32)[g]).to(torch.float32) * scales.to(torch.float32)[g]
    return w.to(scales.dtype).t()


def fuse_runtime(parts: list[dict]) -> dict:
    """One run-time layout for layers sharing their input (q/k/v, gate/up), outputs concatenated in
    order; the parts must share `in_features`, `group_size`, the scales' dtype and `g_idx`."""
    first = parts[0]
    if len(parts) == 1:
        return first
    return {"qweight": torch.cat([p["qweight"] for p in parts], dim=1),
            "scales": torch.cat([p["scales"] for p in parts], dim=1),
            "zeros": torch.cat([p["zeros"] for p in parts], dim=1),
            "g_idx": first["g_idx"], "group_size": first["group_size"], "in_features": first["in_features"]}


def fusable(parts: list[dict]) -> str | None:
    """Why `parts` cannot share one run-time layout (None when they can)."""
    first = parts[0]
    for p in parts[1:]:
        if (p["in_features"], p["group_size"]) != (first["in_features"], first["group_size"]):
            return "their inputs or group sizes differ"
        if p["scales"].dtype != first["scales"].dtype:
            return "their scales' dtypes differ"
        if (p["g_idx"] is None) != (first["g_idx"] is None) or (
                p["g_idx"] is not None and not torch.equal(p["g_idx"], first["g_idx"])):
            return "their act-order g_idx differ"
    return None


@use_kernel_forward_from_hub("Int4CheckpointLinear")
class Int4CheckpointLinear(nn.Module):
    """y = x @ W.T + b with W[n, k] = (q[k, n] - zeros[g, n]) * scales[g, n], g = g_idx[k] or k // group_size.

    Kernel layers read `execution`, `qweight` int32 [ceil(K/8), N], `scales` [G, N], `zeros` int8 [G, N],
    `g_idx` [K] int32 or None, `group_size` (0: per channel) and `bias`; `weight` [N, K] when dequantized."""

    def __init__(self, in_features: int, out_features: int, groups: int, group_size: int, execution: str, *,
                 scale_dtype: torch.dtype = torch.float16, act_order: bool = False, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta") -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.execution = execution
        n, k = out_features, in_features
        packed = execution != "dequantized"
        self.register_buffer("qweight",
                             torch.empty(-(-k // 8), n, dtype=torch.int32, device=device) if packed else None)
        self.register_buffer("scales", torch.empty(groups, n, dtype=scale_dtype, device=device) if packed else None)
        self.register_buffer("zeros", torch.empty(groups, n, dtype=torch.int8, device=device) if packed else None)
        self.register_buffer("g_idx",
                             torch.empty(k, dtype=torch.int32, device=device) if packed and act_order else None)
        self.register_buffer("weight", None if packed else torch.empty(n, k, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(n, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_runtime(cls, runtime: dict, bias: torch.Tensor | None = None, execution: str = "packed",
                     dtype: torch.dtype | None = None) -> Int4CheckpointLinear:  # fmt: skip
        """A layer holding `runtime` (from `to_runtime`): packed, or its weight widened to `dtype` if dequantized."""
        scales = runtime["scales"]
        dtype = dtype or (bias.dtype if bias is not None else scales.dtype)
        layer = cls(runtime["in_features"], runtime["qweight"].shape[1], scales.shape[0], runtime["group_size"],
                    execution, scale_dtype=scales.dtype, act_order=runtime["g_idx"] is not None,
                    bias=bias is not None, dtype=dtype, device="meta")  # fmt: skip
        tensors = {"bias": bias} if bias is not None else {}
        if execution == "dequantized":
            tensors["weight"] = runtime_weight(runtime["qweight"], scales, runtime["zeros"], runtime["g_idx"],
                                               runtime["group_size"], runtime["in_features"]).to(dtype)  # fmt: skip
        else:
            tensors |= {k: runtime[k] for k in ("qweight", "scales", "zeros", "g_idx") if runtime[k] is not None}
        layer.load_state_dict(tensors, strict=True, assign=True)
        return layer

    def nbytes(self) -> int:
        """Bytes the layer's weight takes: words, scales, zero points and the act-order index, or the
        widened weight."""
        held = (self.qweight, self.scales, self.zeros, self.g_idx, self.weight)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if self.execution == "dequantized":
            return F.linear(x, self.weight, self.bias)
        # the weight rounded to the scales' dtype, then to x's, an fp32 matmul
        w = runtime_weight(self.qweight, self.scales, self.zeros, self.g_idx, self.group_size, self.in_features)
        y = F.linear(x.to(torch.float32), w.to(x.dtype).to(torch.float32),
                     None if self.bias is None else self.bias.to(torch.float32))  # fmt: skip
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, act_order={self.g_idx is not None}, execution={self.execution}")
