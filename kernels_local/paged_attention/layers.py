"""Kernel layers replacing the model's `PagedAttention` forward (`kernels` layer rules).

Each layer is stateless: no `__init__`, only `forward(self, query, kv, decode)`, where
`decode` is the step's decode rows: `block_tables` [N, MB], `seq_lens` [N] and `max_len` for
the kernel, and `attend(query, kv, window, softcap, scale, sinks)`, the torch path (SDPA over the
rows' K/V, which the worker may keep contiguous across steps instead of gathering them).
`self` is the model's `PagedAttention`, whose attention options (`sliding_window`,
`softcap`, `scale`, and gpt-oss's `sinks`; None where the layer does not set them) both paths honour. The Triton
layers differ only in their launch tuning; on CPU tensors they take the torch path.
`COMPILE_SPECS` names, per Triton layer, the launches its forward can make (the preflight
compiles them ahead of time); each entry's tuning is the one its forward passes.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .paged_attention import (
    HOPPER,
    PRE_HOPPER,
    ROCM,
    PagedAttentionTuning,
    compile_specs,
    paged_decode,
    runs_triton,
)


def _options(module: nn.Module) -> tuple:
    """The layer's (sliding window, softcap, scale, sinks) as its attention set them; None where unset."""
    return (getattr(module, "sliding_window", None), getattr(module, "softcap", None), getattr(module, "scale", None),
            getattr(module, "sinks", None))


def _triton_or_torch(module: nn.Module, query: torch.Tensor, kv: torch.Tensor, decode,
                     tuning: PagedAttentionTuning) -> torch.Tensor:  # fmt: skip
    window, softcap, scale, sinks = _options(module)
    if not runs_triton(query):
        return decode.attend(query, kv, window, softcap, scale, sinks)
    return paged_decode(query, kv, decode.block_tables, decode.seq_lens, decode.max_len, tuning=tuning,
                        window=window, softcap=softcap, scale=scale, sinks=sinks)  # fmt: skip


class PagedAttention(nn.Module):
    """Torch (CPU): SDPA over the rows' K/V."""

    def forward(self, query: torch.Tensor, kv: torch.Tensor, decode) -> torch.Tensor:
        return decode.attend(query, kv, *_options(self))


class PagedAttentionTritonSm70(nn.Module):
    """Triton, pre-Hopper tuning (sm_70..sm_89): 64-position tiles, 4 warps."""

    has_backward = False

    def forward(self, query: torch.Tensor, kv: torch.Tensor, decode) -> torch.Tensor:
        return _triton_or_torch(self, query, kv, decode, PRE_HOPPER)


class PagedAttentionTritonSm90(nn.Module):
    """Triton, Hopper-and-later tuning (sm_90+): up to 128-position tiles, 8 warps."""

    has_backward = False

    def forward(self, query: torch.Tensor, kv: torch.Tensor, decode) -> torch.Tensor:
        return _triton_or_torch(self, query, kv, decode, HOPPER)


class PagedAttentionTritonRocm(nn.Module):
    """Triton, ROCm tuning (64-lane wavefronts)."""

    has_backward = False

    def forward(self, query: torch.Tensor, kv: torch.Tensor, decode) -> torch.Tensor:
        return _triton_or_torch(self, query, kv, decode, ROCM)


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "PagedAttentionTritonSm70": partial(compile_specs, PRE_HOPPER),
    "PagedAttentionTritonSm90": partial(compile_specs, HOPPER),
    "PagedAttentionTritonRocm": partial(compile_specs, ROCM),
}
