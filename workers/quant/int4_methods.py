"""The 4-bit methods of the registry: which reader takes a `quantization_config`, and the device rule.

Design: `handles(qc)` says whether a config is one of the 4-bit formats (`quant_method` gptq or awq,
or compressed-tensors whose groups are `pack-quantized` integers: compressed-tensors' fp8 formats
keep their own reader), `read(qc)` returns its `Int4Config`. The registry (registry.py) asks here
first, so adding the 4-bit methods touched it by one hook. `int4_execution(device_type, capability)`
is the one rule for how a device runs 4-bit weights (its kind from the torch-free contract,
workers/contract/int4_rule.py, which placement reads too), with its reason, and the kernel mapping's
`Int4CheckpointLinear` entries (kernels_local/mapping.py) follow the same capability ranges (a test
walks them together):
- `w4a16` (CUDA sm_75+ and ROCm): the packed words, scales and zero points stay resident; the Triton
  W4A16 GEMM (kernels_local/int4_linear/) unpacks them in registers, act-order through its `g_idx`
  gather (a permuted load);
- `packed` (CPU): the same packed tensors stay resident; each forward dequantizes the layer in torch
  and runs an fp32 matmul. torch's `_weight_int4pack_mm_for_cpu` is not used: it computes the affine
  weight `(q - 8) * s + zero` exactly in fp32, while the references round `(q - z) * s` to the
  fp16/bf16 scales (measured on a 64 x 128 layer: outputs 2e-4 of their magnitude apart with fp16
  scales, 1.5e-3 with bf16), and with 16-bit activations it rounds in their dtype; it would equal the
  reference only for fp32 scales and activations (checkpoints store fp16 or bf16 scales);
- `dequantized` (CUDA below sm_75, where Triton has no 16-bit mma): the weights are widened at load
  into the model dtype (the widened bytes are reported), a plain matmul.
The trade-off: the CPU's packed execution is slower per step than a bf16 matmul (it dequantizes every
call) in exchange for a quarter of the memory; the dequantized fallback costs the memory instead.
"""

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
