"""`GGUFExperts`: a MoE layer's experts holding a GGUF file's stacked blocks, one GEMV/GEMM per active expert.

Design: llama.cpp stacks each projection of every expert in one tensor (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, [E, rows, bytes per row]); this layer keeps expert `e`'s rows as a
`GGUFLinear` (gate and up joined as `FusedMoE`'s `w_gate_up` is: gate rows then up rows, one layer
per run of a type, as Q4_K_M's Q4_K gate/up and Q6_K down), so each expert's projections run the
same per-device kernel layer as the dense projections (the gguf_linear GEMV for a few rows, the GEMM
for more) and fall back with them. `forward` groups the token-expert pairs by expert exactly as
`FusedMoE`'s torch path does (one stable sort, experts added in ascending order). Trade-off: one
launch per active expert and projection instead of a fused grouped GEMM over the blocks; the
stacked bytes are held once (each expert's layer views its rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.gguf.linear import GGUFFusedLinear, GGUFLinear

ACTIVATIONS = ("silu", "gelu_tanh")  # the experts' activations of the GGUF families with experts


def _activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """[n, 2I] gate rows then up rows -> [n, I]."""
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up


class GGUFExperts(nn.Module):
    """The experts of one layer. `forward(x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H]`."""

    def __init__(self, num_experts: int, hidden: int, gate_up: list[tuple[str, int]], down_type: str,
                 activation: str = "silu", *, device: torch.device | str = "meta") -> None:  # fmt: skip
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"Unsupported GGUF expert activation `{activation}`. Supported: {', '.join(ACTIVATIONS)}")
        intermediate = sum(rows for _, rows in gate_up) // 2
        self.num_experts, self.activation = num_experts, activation
        self.gate_up = nn.ModuleList(
            GGUFLinear(hidden, gate_up[0][1], gate_up[0][0], device=device) if len(gate_up) == 1
            else GGUFFusedLinear(hidden, gate_up, device=device) for _ in range(num_experts))
        self.down = nn.ModuleList(GGUFLinear(intermediate, hidden, down_type, device=device)
                                  for _ in range(num_experts))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        k = topk_ids.shape[1]
        flat = topk_ids.flatten()  # [T*K]
        order = flat.argsort(stable=True)  # pairs grouped by expert, tokens ascending within each
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k  # [T*K] the token of each sorted pair
        xs = x.index_select(0, tokens)  # [T*K, H]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = self.gate_up[e](xs[start:start + n])  # [n, 2I]
                ys[start:start + n] = self.down[e](_activation(h, self.activation))  # [n, H]
                start += n
        ys = ys * topk_weights.flatten().index_select(0, order)[:, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, ys)  # [T, H]

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, activation={self.activation}"
