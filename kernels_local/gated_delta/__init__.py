"""hetserve-gated-delta: the gated delta rule of Gated DeltaNet layers (Qwen3.5, Qwen3-Next) over
a per-sequence state pool, in Triton (CUDA/ROCm: chunked prefill and one-step decode, tuned per
architecture) and torch (CPU)."""

from . import layers
from .gated_delta import (
    TUNINGS,
    GatedDeltaTuning,
    chunk_reference,
    gated_delta_chunks,
    gated_delta_reference,
    gated_delta_step,
    runs_triton,
    step_reference,
)

__all__ = [
    "TUNINGS",
    "GatedDeltaTuning",
    "chunk_reference",
    "gated_delta_chunks",
    "gated_delta_reference",
    "gated_delta_step",
    "layers",
    "runs_triton",
    "step_reference",
]
