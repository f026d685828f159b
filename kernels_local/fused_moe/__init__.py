"""hetserve-fused-moe: the experts of a mixture-of-experts layer as a grouped GEMM in Triton
(CUDA/ROCm, tuned per architecture) and torch (CPU); a pre-quantized checkpoint's fp8 experts
through the same grouped GEMM on e4m3 weights, weight-only or native (`fp8.py`), and gpt-oss's
MXFP4 experts with e2m1 codes decoded in registers (`mxfp4.py`)."""

from . import layers
from .fused_moe import (
    TUNINGS,
    FusedMoETuning,
    MoEConfig,
    align_pairs,
    fused_moe,
    runs_triton,
)
from .torch_path import fused_moe_reference, fused_moe_torch

__all__ = [
    "TUNINGS",
    "FusedMoETuning",
    "MoEConfig",
    "align_pairs",
    "fused_moe",
    "fused_moe_reference",
    "fused_moe_torch",
    "layers",
    "runs_triton",
]
