"""`GGUFExperts`: a MoE layer's experts holding a GGUF file's stacked blocks, run by a grouped kernel.

Design: llama.cpp stacks each projection of every expert in one tensor (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, [E, rows, bytes per row], each of one type, as Q4_K_M's Q4_K gate/up
and Q6_K down); this layer holds the three as the file stores them (`gate_qweight`, `up_qweight`,
`down_qweight`, uint8) with their `types`. The kernel layers (kernels_local/gguf_linear, through the
kernel mapping's `GGUFExperts` entries) run them per device: on CUDA and ROCm one grouped GEMM per
projection over every active expert (the blocks decoded in registers), on the CPU each active
expert's projections through the C++ GEMV. This class's `forward` is their torch reference (one
reference projection per active expert, pairs grouped by expert, the kernel's roundings).
`fall_back(reason)` widens the blocks once into dense `w_gate`, `w_up`, `w_down`: what a worker does
when the kernel fails its self-test on its device. Trade-off: the experts' padded blocks waste most
of a decode's dot rows, for one launch over every active expert instead of one per expert.
"""

from __future__ import annotations

import torch
from kernels import use_kernel_forward_from_hub
from torch import nn

from kernels_local.gguf_linear.gguf_moe import ACTIVATIONS
from kernels_local.gguf_linear.layers import run_experts
from workers.contract.gguf_rule import GGUF_EXACT
from workers.gguf.dequant import dequantize
from workers.gguf.linear import DEQUANTIZED, PACKED, row_bytes

__all__ = ["ACTIVATIONS", "GGUFExperts"]


@use_kernel_forward_from_hub("GGUFExperts")
class GGUFExperts(nn.Module):
    """The experts of one layer. `forward(x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H]`.

    Kernel layers read `execution`, `gate_qweight`, `up_qweight`, `down_qweight`, `types`, `activation`,
    `activations`, and `w_gate`, `w_up`, `w_down` once dequantized."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, types: tuple[str, str, str],
                 activation: str = "silu", *, device: torch.device | str = "meta") -> None:  # fmt: skip
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"Unsupported GGUF expert activation `{activation}`. Supported: {', '.join(ACTIVATIONS)}")
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.types, self.activation = tuple(types), activation
        self.execution = PACKED
        self.activations = GGUF_EXACT  # or int8: the CPU GEMV rounds a decode's rows (`set_activations`)
        self.fallback_reason: str | None = None
        for name, t, rows, k in self._pieces():
            self.register_buffer(f"{name}_qweight", torch.empty(num_experts, rows, row_bytes(t, k), dtype=torch.uint8,
                                                                device=device))  # fmt: skip
            self.register_buffer(f"w_{name}", None)

    def _pieces(self) -> tuple[tuple[str, str, int, int], ...]:
        """(name, type, rows, inputs) of gate, up and down."""
        h, i = self.hidden, self.intermediate
        return ("gate", self.types[0], i, h), ("up", self.types[1], i, h), ("down", self.types[2], h, i)

    @property
    def elements(self) -> int:
        """Weight elements the three stacked tensors hold."""
        return 3 * self.num_experts * self.hidden * self.intermediate

    def fall_back(self, reason: str, dtype: torch.dtype = torch.float32) -> None:
        """Hold the experts dequantized (exactly as gguf-py does, in `dtype`) from now on, with the reason."""
        if self.execution == DEQUANTIZED:
            return
        for name, t, rows, k in self._pieces():
            q = getattr(self, f"{name}_qweight")
            setattr(self, f"w_{name}", torch.stack([dequantize(q[e], t, (rows, k)) for e in range(len(q))]).to(dtype))
            setattr(self, f"{name}_qweight", None)
        self.execution, self.fallback_reason = DEQUANTIZED, reason

    def nbytes(self) -> int:
        held = (self.gate_qweight, self.up_qweight, self.down_qweight) if self.execution == PACKED \
            else (self.w_gate, self.w_up, self.w_down)  # fmt: skip
        return sum(t.numel() * t.element_size() for t in held)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return run_experts(self, x, topk_ids, topk_weights, None)  # x [T, H] -> [T, H]

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}, "
                f"types={'/'.join(self.types)}, activation={self.activation}, execution={self.execution}")
