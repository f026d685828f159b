"""hetserve-paged-attention: decode attention over a paged KV cache in Triton (CUDA/ROCm,
tuned per architecture) and torch (CPU)."""

from . import layers
from .paged_attention import (
    TUNINGS,
    PagedAttentionTuning,
    paged_decode,
    paged_decode_reference,
    runs_triton,
)

__all__ = ["TUNINGS", "PagedAttentionTuning", "layers", "paged_decode", "paged_decode_reference", "runs_triton"]
