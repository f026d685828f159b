"""Kernel layers replacing the model's `GatedDeltaRule` forward (`kernels` layer rules).

Each layer is stateless: no `__init__`, only `forward(self, q, k, v, g, beta, state, batch)` (the
operands as gated_delta.py lays them out; `state` updated in place; `batch` the step's decode rows,
prefill spans and their slots, see `_torch_path`). `self` is the model's `GatedDeltaRule`, with
`chunk` (the torch path's chunk length) and `token_by_token` (deterministic mode: every token one
recurrent step, so chunking cannot change a row's numbers). The Triton layers differ only in their
launch tuning; on CPU tensors, and in deterministic mode, they take the torch path, as the fused
MoE does for its fixed tiles: the trade-off of bits independent of the batch is the recurrent
form's speed. `COMPILE_SPECS` names, per Triton layer, the launches its forward can make.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .gated_delta import (
    HOPPER,
    PRE_HOPPER,
    ROCM,
    GatedDeltaTuning,
    compile_specs,
    gated_delta_chunks,
    gated_delta_reference,
    gated_delta_step,
    runs_triton,
)


def _torch_path(module: nn.Module, q, k, v, g, beta, state: torch.Tensor, batch) -> torch.Tensor:
    """The reference over the step: q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, g (fp32) and beta `[T, Hv]`
    the packed tokens, `state` `[S, Hv, Dk, Dv]` fp32 every slot's state (updated in place), and
    `batch` the step's batch: its `decode` rows (`rows`, `rows_start`), its `prefills` spans
    (`row_start`, `num_tokens`) and `states` (`decode_slots` [Nd], `prefill_slots`, `prefills`
    [P, 3] row start, tokens, slot)."""
    decode, states = batch.decode, batch.states
    rows = None if decode is None else (
        decode.rows if decode.rows_start is None else slice(decode.rows_start, decode.rows_start + decode.num))
    spans = [(p.row_start, p.num_tokens, slot) for p, slot in zip(batch.prefills, states.prefill_slots, strict=True)]
    return gated_delta_reference(q, k, v, g, beta, state, rows, states.decode_slots, spans,
                                 getattr(module, "chunk", 64), getattr(module, "token_by_token", False))  # fmt: skip


def _triton_or_torch(module: nn.Module, q, k, v, g, beta, state: torch.Tensor, batch,
                     tuning: GatedDeltaTuning) -> torch.Tensor:  # fmt: skip
    if not runs_triton(q) or getattr(module, "token_by_token", False):
        return _torch_path(module, q, k, v, g, beta, state, batch)
    out = torch.empty_like(v)  # [T, Hv, Dv]
    if batch.decode is not None:
        gated_delta_step(q, k, v, g, beta, state, batch.decode.rows, batch.states.decode_slots, out, tuning)
    if batch.states.prefills is not None:
        gated_delta_chunks(q, k, v, g, beta, state, batch.states.prefills, out, tuning)
    return out


class GatedDeltaRule(nn.Module):
    """Torch (CPU): decode rows one recurrent step each, prefill spans chunked."""

    def forward(self, q, k, v, g, beta, state: torch.Tensor, batch) -> torch.Tensor:
        return _torch_path(self, q, k, v, g, beta, state, batch)


class GatedDeltaRuleTritonSm70(nn.Module):
    """Triton, pre-Hopper tuning (sm_70..sm_89): 16-token chunks, 32 state columns, 16-wide key blocks, 4 warps."""

    has_backward = False

    def forward(self, q, k, v, g, beta, state: torch.Tensor, batch) -> torch.Tensor:
        return _triton_or_torch(self, q, k, v, g, beta, state, batch, PRE_HOPPER)


class GatedDeltaRuleTritonSm90(nn.Module):
    """Triton, Hopper-and-later tuning (sm_90+): 16-token chunks, 32 state columns, 16-wide key blocks, 16 warps."""

    has_backward = False

    def forward(self, q, k, v, g, beta, state: torch.Tensor, batch) -> torch.Tensor:
        return _triton_or_torch(self, q, k, v, g, beta, state, batch, HOPPER)


class GatedDeltaRuleTritonRocm(nn.Module):
    """Triton, ROCm tuning (64-lane wavefronts): 16-token chunks, 64 state columns, 32-wide key blocks."""

    has_backward = False

    def forward(self, q, k, v, g, beta, state: torch.Tensor, batch) -> torch.Tensor:
        return _triton_or_torch(self, q, k, v, g, beta, state, batch, ROCM)


# Ahead-of-time compile specs of each Triton layer: `spec(workload) -> (CompileSpec, ...)`.
COMPILE_SPECS = {
    "GatedDeltaRuleTritonSm70": partial(compile_specs, PRE_HOPPER),
    "GatedDeltaRuleTritonSm90": partial(compile_specs, HOPPER),
    "GatedDeltaRuleTritonRocm": partial(compile_specs, ROCM),
}
