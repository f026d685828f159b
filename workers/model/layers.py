"""Reference layers that `kernels.kernelize` may swap: RMSNorm, SiluAndMul, PagedAttention.

Design: each class is the pure-torch reference forward, decorated with
`kernels.use_kernel_forward_from_hub(<name>)`. Kernel layers replacing them are
stateless and take the same forward signature; they read the module's attributes, so
RMSNorm keeps transformers' names `weight` and `variance_epsilon` (LlamaRMSNorm), and
SiluAndMul and PagedAttention have no state at all. Numerics follow transformers: RMSNorm
normalises in fp32 and casts back before the weight multiply; PagedAttention is SDPA's
softmax(q k^T / sqrt(D)) v over each row's cached positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels import use_kernel_forward_from_hub
from torch import nn


@use_kernel_forward_from_hub("RMSNorm")
class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H]
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)  # [..., 1]
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


@use_kernel_forward_from_hub("SiluAndMul")
class SiluAndMul(nn.Module):
    """silu(gate) * up for x = cat(gate, up) along the last dim: [..., 2I] -> [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


@use_kernel_forward_from_hub("PagedAttention")
class PagedAttention(nn.Module):
    """Decode attention over the paged KV cache: one query token per sequence, any position.

    `query` [Nd, Hq, D]; `kv` one layer's blocks [2, Hkv, NB, B, D], this step's K/V already
    written; `decode` the step's `workers.kv.DecodeRows` (block tables [Nd, MB], lengths [Nd],
    `max_len`) -> [Nd, Hq, D]. The torch path is the rows' own `attend`: SDPA over the rows'
    K/V (mirrored, viewed or gathered from their blocks), GQA folded into the query axis.
    """

    def forward(self, query: torch.Tensor, kv: torch.Tensor, decode) -> torch.Tensor:
        return decode.attend(query, kv)
