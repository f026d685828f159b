"""hetserve-gguf-linear: linear layers on GGUF blocks (Q8_0..Q5_1, Q2_K..Q6_K, IQ4) dequantized in registers,
a Triton GEMV and GEMM, and a MoE layer's GGUF experts through a grouped GEMM, with their torch references."""

from . import layers
from .gguf_linear import GEMV_MAX_M, TUNINGS, TYPES, GGUFLinearTuning, gguf_linear
from .gguf_moe import MOE_TUNINGS, GGUFMoETuning, gguf_moe, gguf_moe_experts
from .reference import BLOCKS, dequantize_rows, gguf_linear_reference

__all__ = ["BLOCKS", "GEMV_MAX_M", "MOE_TUNINGS", "TUNINGS", "TYPES", "GGUFLinearTuning", "GGUFMoETuning",
           "dequantize_rows", "gguf_linear", "gguf_linear_reference", "gguf_moe", "gguf_moe_experts", "layers"]
