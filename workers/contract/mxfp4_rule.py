"""The MXFP4 rule's device side, torch-free: which devices keep gpt-oss's MXFP4 experts packed.

Design: one threshold decides how a device runs a checkpoint's MXFP4 experts, and every reader takes
it from here: the loader (workers/quant/mxfp4_reader.py, through workers/quant/mxfp4.py
`mxfp4_execution`, which adds the reason), the kernel mapping (kernels_local/mapping.py, whose
`Mxfp4FusedMoE` ranges a test holds equal to it) and placement (workers/contract/model_size.py, which
sizes the packed bytes where they stay packed and the widened experts where they do not).
`mxfp4_kind`: `w4a16` on CUDA from sm_80 and on every ROCm arch (the Triton grouped GEMM decodes the
e2m1 codes in registers and multiplies on the 16-bit tensor cores: the fused MoE layer's own range,
since below sm_80 Triton lowers its dots to FMAs), `dequantized` below sm_80 and on the CPU (the
experts widened at load into the model dtype, then the device's `FusedMoE`). The trade-off: a Turing
card holds the experts at their widened size, as the unquantized checkpoint would be.
"""

from __future__ import annotations

from workers.contract.capability import Capability

MXFP4_W4A16 = "w4a16"  # the experts stay packed; e2m1 decoded inside the Triton grouped GEMM
MXFP4_DEQUANTIZED = "dequantized"  # widened at load into the model dtype
MXFP4_EXECUTIONS = (MXFP4_W4A16, MXFP4_DEQUANTIZED)
MXFP4_CAPABILITY = Capability(8, 0)  # the fused MoE layer's Triton range on CUDA (mma from sm_80)


def mxfp4_kind(device_type: str, capability) -> str:
    """How `device_type` at `capability` runs MXFP4 experts: one of `MXFP4_EXECUTIONS`. Pure."""
    if device_type == "cpu":
        return MXFP4_DEQUANTIZED
    cap = Capability.parse_optional(capability)
    if device_type == "rocm" or (cap is not None and cap >= MXFP4_CAPABILITY):
        return MXFP4_W4A16
    return MXFP4_DEQUANTIZED
