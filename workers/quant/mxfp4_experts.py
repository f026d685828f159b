"""`Mxfp4FusedMoE`: gpt-oss's MXFP4 experts kept packed, for devices whose rule keeps them so.

Design: the experts of one layer as `FusedMoE` holds them, but as the checkpoint's e2m1 bytes and
e8m0 exponents in our row order (`w_gate_up_blocks` [E, 2I, H/2], `w_gate_up_scales` [E, 2I, H/32],
`w_down_blocks` [E, H, I/2], `w_down_scales` [E, H, I/32]) with the biases in the model dtype; the
loader never converts a value. It is kernel-swappable (kernels_local/fused_moe: the grouped GEMM
decoding the codes in registers); `forward` is the torch reference: each active expert dequantized,
then the fp8 experts' loop (`run_experts`), so a packed layer computes bit for bit what experts
dequantized at load compute. Trade-off: the reference (a simulated GPU's CPU path) dequantizes an
active expert on every call: time, never memory held."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels import use_kernel_forward_from_hub
from torch import nn

from workers.quant.experts import ACTIVATIONS, expert_activation, run_experts
from workers.quant.mxfp4 import BLOCK, dequantize


def _weight(blocks: torch.Tensor, scales: torch.Tensor, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert `e`'s weight [N, K] in `dtype` from the packed blocks [E, N, K/2] and scales [E, N, K/32]."""
    n, half = blocks.shape[1:]
    return dequantize(blocks[e].view(n, half * 2 // BLOCK, BLOCK // 2), scales[e], dtype)


@use_kernel_forward_from_hub("Mxfp4FusedMoE")
class Mxfp4FusedMoE(nn.Module):
    """The MXFP4 experts of one layer. `forward(x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H]`.

    Kernel layers read `w_gate_up_blocks`, `w_gate_up_scales`, `w_down_blocks`, `w_down_scales`,
    `b_gate_up`, `b_down`, `activation`, `alpha`, `limit`, `row_tile` and `execution` ("w4a16")."""

    execution = "w4a16"

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool = False,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta") -> None:  # fmt: skip
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"Unknown expert activation `{activation}`. Supported: {', '.join(ACTIVATIONS)}"
            )
        if hidden % BLOCK or intermediate % BLOCK:
            raise ValueError(f"MXFP4 experts need hidden and intermediate sizes in whole blocks of {BLOCK}; got "
                             f"{hidden} and {intermediate}")  # fmt: skip
        e, h, i = num_experts, hidden, intermediate
        self.num_experts, self.activation, self.alpha, self.limit = e, activation, alpha, limit
        self.compute_dtype = dtype
        self.row_tile: int | None = None  # deterministic mode: each expert's rows in fixed tiles
        for name, (n, k) in (("w_gate_up", (2 * i, h)), ("w_down", (h, i))):
            self.register_buffer(
                f"{name}_blocks", torch.empty(e, n, k // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer(
                f"{name}_scales", torch.empty(e, n, k // BLOCK, dtype=torch.uint8, device=device)
            )
        self.b_gate_up = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype, device=device)) if bias else None
        self.b_down = nn.Parameter(torch.empty(e, h, dtype=dtype, device=device)) if bias else None

    def nbytes(self) -> int:
        """Bytes the experts' weights take: the e2m1 blocks and their scales."""
        return sum(t.numel() * t.element_size() for t in (self.w_gate_up_blocks, self.w_gate_up_scales,
                                                            self.w_down_blocks, self.w_down_scales))  # fmt: skip

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # x [T, H] -> [T, H]: the experts dequantized into x's dtype as the grouping reaches them
        b1, b2 = self.b_gate_up, self.b_down

        def expert(e: int, part: torch.Tensor) -> torch.Tensor:
            w1 = _weight(self.w_gate_up_blocks, self.w_gate_up_scales, e, x.dtype)  # [2I, H]
            h = F.linear(part, w1, None if b1 is None else b1[e])  # [rows, 2I]
            w2 = _weight(self.w_down_blocks, self.w_down_scales, e, x.dtype)  # [H, I]
            return F.linear(expert_activation(h, self.activation, self.alpha, self.limit), w2,
                            None if b2 is None else b2[e])  # [rows, H]

        return run_experts(x, topk_ids, topk_weights, self.num_experts, self.row_tile, expert)

    def extra_repr(self) -> str:
        e, n, half = self.w_gate_up_blocks.shape
        return (
            f"experts={e}, hidden={half * 2}, intermediate={n // 2}, mxfp4 blocks of {BLOCK}, execution=w4a16"
        )
