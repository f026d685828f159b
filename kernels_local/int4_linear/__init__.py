"""hetserve-int4-linear: W4A16 linear (4-bit weights unpacked in registers) in Triton, with its torch reference."""

from . import layers
from .int4_linear import TUNINGS, Int4LinearTuning, int4_linear, int4_linear_reference, unpack_weight

__all__ = ["TUNINGS", "Int4LinearTuning", "int4_linear", "int4_linear_reference", "layers", "unpack_weight"]
