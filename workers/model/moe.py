"""Mixture-of-experts feed-forward: a router picks each token's experts, `FusedMoE` runs them.

Design: the family's router (softmax then top-k, renormalized or not; or top-k of biased logits
then softmax) gives each token `K` expert ids and weights, and `FusedMoE`, kernel-swappable like
RMSNorm, runs the experts over one stacked layout for every family: `w_gate_up` [E, 2I, H] (gate
rows, then up rows), `w_down` [E, H, I], optional biases (the loader turns gpt-oss's interleaved,
transposed tensors into it); activations `silu`, `gelu_tanh` (Gemma 4) and `swiglu_oai` (gpt-oss's
clamped SwiGLU). The torch path groups the token-expert pairs by expert with one stable sort and
runs one matmul per active expert (under `--deterministic` in fixed `row_tile` tiles); inside
`torch.compile` the experts are one opaque op (`hetserve::grouped_experts`), so the grouping's
data-dependent sizes stay out of the graph. Trade-off: in the torch path an expert with few rows
pays a whole matmul call; the kernel layers group them into one call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels import use_kernel_forward_from_hub
from torch import nn

MOE_ACTIVATIONS = ("silu", "swiglu_oai", "gelu_tanh")


def expert_activation(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] gate rows then up rows -> [n, I]."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":  # Gemma 4's experts
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _tiles(x: torch.Tensor, tile: int | None):
    """`x` [n, H] as slices of `tile` rows (the last zero-padded); all of it without a tile."""
    if tile is None:
        yield x, x.shape[0]
        return
    for start in range(0, x.shape[0], tile):
        part = x[start : start + tile]
        n = part.shape[0]
        yield (part if n == tile else F.pad(part, (0, 0, 0, tile - n))), n


def grouped_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, b_gate_up: torch.Tensor | None = None,
                    b_down: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                    limit: float = 7.0, row_tile: int | None = None) -> torch.Tensor:
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]): `x` [T, H], `topk_ids` [T, K], `topk_weights`
    [T, K] -> [T, H] in `x`'s dtype, experts added in ascending order (as transformers does)."""
    t, k = topk_ids.shape
    flat = topk_ids.flatten()  # [T*K]
    order = flat.argsort(stable=True)  # pairs grouped by expert, tokens ascending within each
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    tokens = order // k  # [T*K] the token of each sorted pair
    xs = x.index_select(0, tokens)  # [T*K, H]
    ys = torch.empty_like(xs)  # [T*K, H]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        done = 0
        for part, rows in _tiles(xs[start : start + n], row_tile):
            h = F.linear(part, w_gate_up[e], None if b_gate_up is None else b_gate_up[e])  # [rows, 2I]
            y = F.linear(expert_activation(h, activation, alpha, limit), w_down[e],
                         None if b_down is None else b_down[e])  # [rows, H]
            ys[start + done : start + done + rows] = y[:rows]
            done += rows
        start += n
    ys = ys * topk_weights.flatten().index_select(0, order)[:, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, ys)  # [T, H]


def _grouped_experts_op():
    """`hetserve::grouped_experts`: `grouped_experts` as one op a compiled graph calls (registered once)."""
    if hasattr(torch.ops.hetserve, "grouped_experts"):
        return torch.ops.hetserve.grouped_experts

    @torch.library.custom_op("hetserve::grouped_experts", mutates_args=())
    def op(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_ids: torch.Tensor,
           topk_weights: torch.Tensor, b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None,
           activation: str, alpha: float, limit: float) -> torch.Tensor:  # fmt: skip
        return grouped_experts(x, w_gate_up, w_down, topk_ids, topk_weights, b_gate_up, b_down, activation, alpha,
                               limit)  # fmt: skip

    op.register_fake(lambda x, *args: torch.empty_like(x))
    return torch.ops.hetserve.grouped_experts


GROUPED_EXPERTS = _grouped_experts_op()


@use_kernel_forward_from_hub("FusedMoE")
class FusedMoE(nn.Module):
    """The experts of one layer. `forward(x [T, H], topk_ids [T, K] int64, topk_weights [T, K])
    -> [T, H]`; the kernel layers replacing it read the same attributes."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, bias: bool = False,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"Unknown expert activation `{activation}`. Supported: {', '.join(MOE_ACTIVATIONS)}")
        self.num_experts, self.activation, self.alpha, self.limit = num_experts, activation, alpha, limit
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # [E, 2I, H]
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))  # [E, H, I]
        self.b_gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if bias else None
        self.b_down = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.row_tile: int | None = None  # deterministic mode: each expert's rows in fixed tiles

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # deterministic mode (row tiles) never compiles
            return GROUPED_EXPERTS(x, self.w_gate_up, self.w_down, topk_ids, topk_weights, self.b_gate_up,
                                   self.b_down, self.activation, float(self.alpha), float(self.limit))  # fmt: skip
        return grouped_experts(x, self.w_gate_up, self.w_down, topk_ids, topk_weights, self.b_gate_up, self.b_down,
                               self.activation, self.alpha, self.limit, self.row_tile)


class SharedExpert(nn.Module):
    """The expert every token goes through (Qwen3-Next, Qwen3.5-MoE): a SwiGLU MLP."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)  # [gate | up]
        self.w_down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(expert_activation(self.w_gate_up(x), "silu", 0.0, 0.0))  # [T, H] -> [T, 2I] -> [T, H]


class MoEFeedForward(nn.Module):
    """A sparse layer's feed-forward: the family's router, then its experts (`FusedMoE`); where the
    family has one, plus a shared expert weighed by `sigmoid(x w)` per token."""

    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k, self.router_kind, self.norm_topk = config.num_experts_per_tok, config.router, config.norm_topk_prob
        self.router = nn.Linear(h, config.num_experts, bias=config.router_bias)
        self.experts = FusedMoE(config.num_experts, h, config.moe_intermediate_size, config.expert_bias,
                                config.expert_activation, config.swiglu_alpha, config.swiglu_limit)
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(h, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, K], weights [T, K] in x's dtype), as the family computes them."""
        logits = self.router(x)  # [T, E]
        if self.router_kind == "topk_softmax":  # gpt-oss: the top-k logits, then softmax over them
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1, dtype=top.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, top.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, H]
        ids, weights = self.route(flat)
        out = self.experts(flat, ids, weights)  # [T, H]
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape)
