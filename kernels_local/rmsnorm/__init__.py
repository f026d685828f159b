"""hetserve-rmsnorm: RMSNorm in Triton (CUDA/ROCm, tuned per architecture) and C++ (CPU), with its torch reference."""

from . import layers
from .rmsnorm import MAX_BLOCK_N, TUNINGS, RMSNormTuning, rms_norm, rms_norm_reference, runs_triton

__all__ = [
    "MAX_BLOCK_N",
    "TUNINGS",
    "RMSNormTuning",
    "layers",
    "rms_norm",
    "rms_norm_reference",
    "runs_triton",
]
