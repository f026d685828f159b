"""hetserve-gguf-linear: linear layers on GGUF blocks (Q8_0..Q5_1, Q2_K..Q6_K, IQ4) dequantized in registers,
a Triton GEMV and GEMM, with their torch reference."""

from . import layers
from .gguf_linear import GEMV_MAX_M, TUNINGS, TYPES, GGUFLinearTuning, gguf_linear
from .reference import BLOCKS, dequantize_rows, gguf_linear_reference

__all__ = ["BLOCKS", "GEMV_MAX_M", "TUNINGS", "TYPES", "GGUFLinearTuning", "dequantize_rows", "gguf_linear",
           "gguf_linear_reference", "layers"]
