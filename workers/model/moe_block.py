"""Gemma 4's MoE block: experts beside the dense MLP, their outputs summed.

Design, as transformers' Gemma4TextDecoderLayer computes it: the dense MLP runs on the
pre-feed-forward norm of the residual `r`; the experts take `r` normed by their own `pre_norm`,
and the router takes `r` too (a scale-less RMSNorm times a learned `router_scale` and 1/sqrt(H),
softmax in fp32, top-k renormalized, each weight times its expert's `per_expert_scale`). The
experts are `FusedMoE`, so a device's kernel swaps in as for any MoE family. Both outputs are
normed (`post_dense_norm`, `post_norm`) and summed. Trade-off: the router reads the residual
rather than a normed input, so it cannot share the MLP's norm."""

from __future__ import annotations

import torch
from torch import nn

from workers.model.attention import make_norm
from workers.model.config import ModelConfig
from workers.model.layers import PowRMSNorm
from workers.model.moe import FusedMoE


class MoEBlock(nn.Module):
    """`forward(dense [..., H], residual [..., H]) -> [..., H]`: the MLP's and the experts' outputs, summed."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, e = config.hidden_size, config.num_experts
        self.top_k, self.root = config.num_experts_per_tok, h**-0.5
        self.router_norm = PowRMSNorm(h, config.rms_norm_eps, with_scale=False)
        self.router = nn.Linear(h, e, bias=False)
        self.router_scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(e))
        self.experts = FusedMoE(e, h, config.moe_intermediate_size, activation=config.expert_activation)
        self.post_dense_norm, self.pre_norm, self.post_norm = (make_norm(config, h) for _ in range(3))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (expert ids [T, K], weights [T, K] fp32)."""
        scores = self.router(self.router_norm(x) * self.router_scale * self.root)  # [T, E]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return ids, top * self.per_expert_scale[ids]

    def forward(self, dense: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        flat = residual.reshape(-1, residual.shape[-1])  # [T, H]
        ids, weights = self.route(flat)
        experts = self.experts(self.pre_norm(flat), ids, weights).reshape(residual.shape)
        return self.post_dense_norm(dense) + self.post_norm(experts)
