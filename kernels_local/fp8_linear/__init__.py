"""hetserve-fp8-linear: fp8 (e4m3) linear in Triton (native and emulated, tuned per
architecture) and torch (CPU)."""

from . import layers
from .fp8_linear import TUNINGS, Fp8LinearTuning, check_weight, fp8_linear, fp8_linear_reference, runs_triton
from .quant import FORMATS, decode, quantize_rows, round_to_grid

__all__ = [
    "FORMATS",
    "TUNINGS",
    "Fp8LinearTuning",
    "check_weight",
    "decode",
    "fp8_linear",
    "fp8_linear_reference",
    "layers",
    "quantize_rows",
    "round_to_grid",
    "runs_triton",
]
