"""hetserve-activation: SiluAndMul in Triton (CUDA/ROCm, tuned per architecture) and C++ (CPU),
with its torch reference.
"""

from . import layers
from .silu_and_mul import TUNINGS, SiluAndMulTuning, runs_triton, silu_and_mul, silu_and_mul_reference

__all__ = ["TUNINGS", "SiluAndMulTuning", "layers", "runs_triton", "silu_and_mul", "silu_and_mul_reference"]
