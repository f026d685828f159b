"""The model's norm, activation and decode-attention layers; three of them `kernels.kernelize` may swap.

Design: RMSNorm, SiluAndMul and PagedAttention are pure-torch reference forwards decorated with
`kernels.use_kernel_forward_from_hub(<name>)`; the stateless kernel layers replacing them read
the module's attributes, so RMSNorm keeps transformers' `weight` and `variance_epsilon` and
PagedAttention only its layer's options (`sliding_window`, `softcap`, `scale`). Numerics follow
transformers (RMSNorm in fp32, cast back before the weight multiply). `FloatRMSNorm` (OLMo,
Gemma), `PowRMSNorm` (Gemma 4) and `GeluTanhAndMul` have no kernels yet and run their torch
forward on every device. Trade-off: the families that use them pay for the unfused ops on a GPU
until a kernel joins the mapping."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels import use_kernel_forward_from_hub
from torch import nn


def embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding table [num, dim] left uninitialized (the checkpoint's weights replace it). Why not
    `nn.Embedding(num, dim)`: under `torch.device("meta")` its `normal_` init goes through torch's
    decompositions, which import `torch._dynamo` (4 s of a worker's start that never compiles)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


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


class FloatRMSNorm(nn.Module):
    """RMSNorm that scales in fp32 and casts last: `(x_n * (offset + w)).to(dtype)` (OLMo: offset
    0; Gemma: offset 1, its weights stored as `w` around zero)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size) if offset == 0.0 else torch.zeros(hidden_size))
        self.variance_epsilon = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H]
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        scale = self.weight.float() if self.offset == 0.0 else self.offset + self.weight.float()
        return (h * scale).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, offset={self.offset}"


class PowRMSNorm(nn.Module):
    """Gemma 4's RMSNorm: `x * pow(mean(x^2) + eps, -0.5)` in fp32 (`pow`, not `rsqrt`, as
    transformers' Gemma4RMSNorm), times `w` in fp32 where it has a scale, cast last. Without a
    scale (its value norm, its router's norm) it has no parameters."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if with_scale else None
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., H]
        h = x.to(torch.float32)
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon, -0.5)
        return (h if self.weight is None else h * self.weight.float()).to(x.dtype)


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up for x = cat(gate, up) along the last dim: [..., 2I] -> [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


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
    written; `decode` the step's `workers.kv.batch.DecodeRows` (block tables [Nd, MB], lengths
    [Nd], `max_len`) -> [Nd, Hq, D]. The layer's options are attributes its attention sets:
    `sliding_window` (a row sees its last that many positions; None: all), `softcap` (scores ->
    cap * tanh(scores / cap); None: off) and `scale` (None: 1/sqrt(D)); a gpt-oss layer also owns
    `sinks` [Hq], a learned logit per head in each softmax (a parameter: no class default). The torch path is the
    rows' own `attend`: SDPA over the rows' K/V (mirrored, viewed or gathered from their
    blocks), GQA folded into the query axis.
    """

    sliding_window: int | None = None
    softcap: float | None = None
    scale: float | None = None

    def forward(self, query: torch.Tensor, kv: torch.Tensor, decode) -> torch.Tensor:
        return decode.attend(query, kv, self.sliding_window, self.softcap, self.scale, getattr(self, "sinks", None))
