"""The 4-bit methods of the registry: which reader takes a `quantization_config`, and the device rule.

Design: `handles(qc)` says whether a config is one of the 4-bit formats (gptq, awq, or
compressed-tensors' `pack-quantized` groups) and `read(qc)` returns its `Int4Config`; the registry
asks here first, through one hook. `int4_execution(device_type, capability)` is the one rule, with
its reason (its kind from the torch-free workers/contract/int4_rule.py, which placement and the
kernel mapping's `Int4CheckpointLinear` ranges follow): `w4a16` (CUDA sm_75+, ROCm: the Triton
GEMM unpacks in registers), `packed` (CPU: each forward dequantizes the layer exactly, since torch's
`_weight_int4pack_mm_for_cpu` does not round as the references do; docs/quantization-int4.md) and
`dequantized` (below sm_75: widened at load). Trade-off: the CPU's packed execution is slower per
step than a bf16 matmul in exchange for a quarter of the memory; the fallback costs the memory."""

from __future__ import annotations

from dataclasses import dataclass

from workers.contract.int4_rule import INT4_DEQUANTIZED, INT4_EXECUTIONS, INT4_PACKED, INT4_W4A16, int4_kind
from workers.quant import awq, gptq, pack_quantized
from workers.quant.int4_scheme import Int4Config

METHODS = {gptq.NAME: gptq.read, awq.NAME: awq.read}
__all__ = ["INT4_DEQUANTIZED", "INT4_EXECUTIONS", "INT4_PACKED", "INT4_W4A16", "Int4Execution", "handles",
           "int4_execution", "read"]


@dataclass(frozen=True)
class Int4Execution:
    kind: str  # one of INT4_EXECUTIONS
    reason: str

    @property
    def packed(self) -> bool:
        """Whether the 4-bit words stay resident (the layer's bytes are the packed ones)."""
        return self.kind != INT4_DEQUANTIZED


def handles(qc: dict) -> bool:
    """Whether `qc` (a `quantization_config`) is a 4-bit format read here."""
    method = qc.get("quant_method")
    return method in METHODS or (method == pack_quantized.NAME and pack_quantized.is_int4(qc))


def read(qc: dict) -> Int4Config:
    method = qc.get("quant_method")
    return pack_quantized.read(qc) if method == pack_quantized.NAME else METHODS[method](qc)


def _tuning(device_type: str, capability: tuple[int, int]) -> str:
    if device_type == "rocm":
        return "its CDNA tuning (64-lane wavefronts, 2 stages)"
    if capability < (8, 0):
        return "its Turing tuning (fp16 mma, 2 stages)"
    if capability < (9, 0):
        return "its Ampere/Ada tuning (16-bit mma, 3 stages)"
    return "its Hopper tuning (128-wide tiles, 8 warps)" + ("" if capability < (10, 0) else ", the newest tuned")


def int4_execution(device_type: str, capability: tuple[int, int] | None) -> Int4Execution:
    """How this device runs 4-bit weights (the contract's `int4_kind`), and why."""
    kind = int4_kind(device_type, capability)
    if kind == INT4_PACKED:
        return Int4Execution(INT4_PACKED, "CPU: 4-bit weights kept packed (a quarter of bf16's bytes), each layer "
                                          "dequantized per call for an fp32 torch matmul (torch's int4pack CPU "
                                          "matmul is affine in fp32, not the reference's weight rounded to its "
                                          "fp16/bf16 scales)")
    cap = None if capability is None else (int(capability[0]), int(capability[1]))
    name = "ROCm" if device_type == "rocm" else ("unknown capability" if cap is None else f"sm_{cap[0]}{cap[1]}")
    if kind == INT4_W4A16:
        return Int4Execution(INT4_W4A16, f"{name}: Triton W4A16 GEMM, 4-bit weights kept packed and unpacked in "
                                         f"registers, {_tuning(device_type, cap or (9, 0))}; act-order by its "
                                         "g_idx gather")
    return Int4Execution(INT4_DEQUANTIZED, f"{name}: below sm_75 Triton has no 16-bit mma for the W4A16 GEMM; "
                                           "4-bit weights dequantized at load into the model dtype (widened "
                                           "bytes shown), plain matmul")
