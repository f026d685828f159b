"""`Int4CheckpointLinear`: a 4-bit checkpoint's linear layer in the one run-time layout the W4A16 kernel reads.

Design: `to_runtime(scheme, stored)` turns any format's stored tensors (workers/quant/int4_pack.py
reads them) into one layout, exactly (only bits move, no value is rounded):
- `qweight` int32 [ceil(K/8), N]: input 8i+j of output n in bits 4j..4j+3 of row i (GPTQ's own
  layout, kept as stored; AWQ's [K, N/8] interleaved words and pack-quantized's [N, K/8] words are
  unpacked and packed again along K);
- `zeros` int8 [G, N]: the zero point each group subtracts (GPTQ v1's stored value plus 1; AWQ's as
  stored; pack-quantized's offset-by-8 value, 8 when symmetric: the weights keep their offset too);
- `scales` [G, N] in the checkpoint's dtype; `g_idx` [K] int32 only for act-order (a GPTQ `g_idx`
  equal to k // group is dropped); `group_size` the format's, 0 per channel.
The weight is `(q - z) * s` rounded once to the scales' dtype, the reference's bits. `forward` is the
pure-torch reference (dequantize, fp32 matmul, bias, cast): what CPU runs, and what the kernel
layers (kernels_local/int4_linear/layers.py, same attributes) are tested against. The trade-off: the
zero points take a byte each per group and output (at group 128, under 1% of the weight's bytes) so
the kernel loads them without a second unpack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
            trivial = torch.arange(k) // group if group else torch.zeros(k, dtype=torch.int64)
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
        zeros = torch.full(scales.shape, 8) if zp is None else unpack_int32(zp, n, dim=0).t()
        g_idx = None
    return {"qweight": qweight.contiguous(), "scales": scales.contiguous(), "zeros": zeros.to(torch.int8).contiguous(),
            "g_idx": g_idx, "group_size": group, "in_features": k}


def runtime_weight(qweight, scales, zeros, g_idx, group_size: int, in_features: int) -> torch.Tensor:
    """The weight [N, K] in the scales' dtype: (q - z) * s, the product exact in fp32, rounded once."""
    q = unpack_int32(qweight, in_features, dim=0)  # [K, N]
    k = torch.arange(in_features, device=qweight.device)
    g = g_idx.long() if g_idx is not None else (k // group_size if group_size else k * 0)
    w = (q - zeros.to(torch.int32)[g]).to(torch.float32) * scales.to(torch.float32)[g]
    return w.to(scales.dtype).t()


class Int4CheckpointLinear(nn.Module):
    """y = x @ W.T + b with W[n, k] = (q[k, n] - zeros[g, n]) * scales[g, n], g = g_idx[k] or k // group_size.

    Kernel layers read `qweight` int32 [ceil(K/8), N], `scales` [G, N], `zeros` int8 [G, N], `g_idx`
    [K] int32 or None, `group_size` (0: per channel) and `bias`."""

    def __init__(self, runtime: dict, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = runtime["in_features"], runtime["qweight"].shape[1]
        self.group_size = runtime["group_size"]
        for name in ("qweight", "scales", "zeros", "g_idx"):
            self.register_buffer(name, runtime[name])
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def nbytes(self) -> int:
        """Bytes the layer's weight takes: words, scales, zero points and the act-order index."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros, self.g_idx)
                   if t is not None)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]; the weight rounded to the scales' dtype, then to x's, an fp32 matmul
        w = runtime_weight(self.qweight, self.scales, self.zeros, self.g_idx, self.group_size, self.in_features)
        y = F.linear(x.to(torch.float32), w.to(x.dtype).to(torch.float32),
                     None if self.bias is None else self.bias.to(torch.float32))  # fmt: skip
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, act_order={self.g_idx is not None}")
