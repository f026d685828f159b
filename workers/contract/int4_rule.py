"""The 4-bit rule's device side, torch-free: which devices keep a 4-bit checkpoint's packed weights.

Design: one threshold decides how a device runs GPTQ, AWQ and pack-quantized layers, and both its
readers take it from here: the worker (workers/quant/int4_methods.py `int4_execution`, which adds the
reason and the kernel mapping follows) and placement (workers/contract/model_size.py, which sizes the
packed bytes where they stay packed and the widened weights where they do not). `int4_kind`:
`w4a16` on CUDA from sm_75 (Triton's 16-bit mma, the W4A16 GEMM) and on every ROCm arch, `packed` on
the CPU (the packed weights dequantized per call), `dequantized` below sm_75 (widened at load). The
trade-off: experts stored in 4 bits have no 4-bit layer yet and widen on every device; that is the
readers' concern, not this rule's.
"""

from __future__ import annotations

from workers.contract.capability import Capability

INT4_W4A16 = "w4a16"  # packed weights resident, unpacked inside the Triton GEMM
INT4_PACKED = "packed"  # packed weights resident, dequantized per call in torch (CPU)
INT4_DEQUANTIZED = "dequantized"  # widened at load into the model dtype
INT4_EXECUTIONS = (INT4_W4A16, INT4_PACKED, INT4_DEQUANTIZED)
W4A16_CAPABILITY = Capability(7, 5)  # Turing: the first CUDA architecture with 16-bit mma in Triton


def int4_kind(device_type: str, capability) -> str:
    """How `device_type` at `capability` runs 4-bit weights: one of `INT4_EXECUTIONS`. Pure."""
    if device_type == "cpu":
        return INT4_PACKED
    cap = Capability.parse_optional(capability)
    if device_type == "rocm" or (cap is not None and cap >= W4A16_CAPABILITY):
        return INT4_W4A16
    return INT4_DEQUANTIZED
