"""Per-layer input embeddings (Gemma 4's PLE): a small extra input for every layer of every token.

Design, as transformers' Gemma4TextModel computes it: a packed table `embed_tokens_per_layer`
[V, L x P] gives each token `L` vectors of `P` values, and a projection of its embedding, RMS-normed
per layer, `L` more; their sum times 1/sqrt(2) is the per-layer input `[T, L, P]`, computed once
per step next to the embedding (`PerLayerInputs`). Layer `i` adds
`norm(projection(gelu(gate(x)) * input_i))` after its feed-forward residual (`PerLayerGate`).
Trade-off: the packed table is the largest tensor of the small Gemma 4 models; it is read one row
per token, so it stays with the other weights rather than being streamed from the host."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention import make_norm
from workers.model.config import ModelConfig
from workers.model.layers import embedding


class PerLayerInputs(nn.Module):
    """`forward(ids [...], x [..., H]) -> [..., L, P]`: each token's input to each layer."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, n, p = config.hidden_size, config.num_hidden_layers, config.per_layer_input_size
        self.layers, self.width = n, p
        self.embed = embedding(config.per_layer_vocab_size, n * p)
        self.projection = nn.Linear(h, n * p, bias=False)
        self.norm = make_norm(config, p)
        self.embed_scale, self.projection_scale, self.combine_scale = p**0.5, h**-0.5, 2.0**-0.5

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.embed_scale, dtype=torch.float32, device=x.device).to(self.embed.weight.dtype)
        token = (self.embed(ids) * scale).unflatten(-1, (self.layers, self.width))  # [..., L, P]
        context = (self.projection(x) * self.projection_scale).unflatten(-1, (self.layers, self.width))
        return (self.norm(context) + token) * self.combine_scale  # [..., L, P]


class PerLayerGate(nn.Module):
    """One layer's use of its input: `x + norm(projection(gelu_tanh(gate(x)) * input))`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, p = config.hidden_size, config.per_layer_input_size
        self.gate = nn.Linear(h, p, bias=False)
        self.projection = nn.Linear(p, h, bias=False)
        self.norm = make_norm(config, h)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.gate(x), approximate="tanh") * per_layer_input  # [..., P]
        return x + self.norm(self.projection(y))  # [..., H]
