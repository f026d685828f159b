"""The 4-bit methods of the registry: which reader takes a `quantization_config`, and the device rule.

Design: `handles(qc)` says whether a config is one of the 4-bit formats (`quant_method` gptq or awq,
or compressed-tensors whose groups are `pack-quantized` integers: compressed-tensors' fp8 formats
keep their own reader), `read(qc)` returns its `Int4Config`. The registry (registry.py) asks here
first, so adding the 4-bit methods touched it by one hook. `int4_execution(device_type, capability)`
is the one rule for how a device runs 4-bit weights, with its reason: today every device
dequantizes at load (the widened bytes are reported), since no 4-bit kernel layer exists yet; the
reason says which kernel each device is meant to get, so the plan reads the same before and after.
The trade-off: a 4-bit checkpoint takes the memory of its dequantized twin until the W4A16 kernels
land; it serves on every device meanwhile, each computing the reference weights exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.quant import awq, gptq, pack_quantized
from workers.quant.int4_scheme import Int4Config

METHODS = {gptq.NAME: gptq.read, awq.NAME: awq.read}
INT4_DEQUANTIZED = "dequantized"


@dataclass(frozen=True)
class Int4Execution:
    kind: str  # "dequantized" (the only one so far)
    reason: str


def handles(qc: dict) -> bool:
    """Whether `qc` (a `quantization_config`) is a 4-bit format read here."""
    method = qc.get("quant_method")
    return method in METHODS or (method == pack_quantized.NAME and pack_quantized.is_int4(qc))


def read(qc: dict) -> Int4Config:
    method = qc.get("quant_method")
    return pack_quantized.read(qc) if method == pack_quantized.NAME else METHODS[method](qc)


def int4_execution(device_type: str, capability: tuple[int, int] | None) -> Int4Execution:
    """How this device runs 4-bit weights, and why."""
    if device_type == "cpu":
        why = "CPU: 4-bit weights dequantized at load (the packed int4 CPU matmul is not wired yet)"
    elif device_type == "rocm" or (capability is not None and tuple(capability) >= (7, 5)):
        name = "ROCm" if device_type == "rocm" else f"sm_{capability[0]}{capability[1]}"
        why = f"{name}: 4-bit weights dequantized at load (the W4A16 Triton GEMM for sm_75+ and ROCm is not built yet)"
    else:
        shown = "unknown capability" if capability is None else f"sm_{capability[0]}{capability[1]}"
        why = f"{shown}: below sm_75 no 4-bit kernel applies; weights dequantized at load"
    return Int4Execution(INT4_DEQUANTIZED, why)
