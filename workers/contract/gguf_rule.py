"""Whether a device keeps a GGUF file's blocks packed: the threshold and the types, torch-free.

Design: the worker's rule with its reason (workers/gguf/execution.py `gguf_rule`) and the router's
sizing of a GGUF model per device (workers/contract/model_size.py) read the same few lines, so the
plan counts the bytes a worker will hold. CUDA from sm_70 (Triton's oldest target) and ROCm keep the
blocks of the types kernels_local/gguf_linear's Triton kernels decode; the CPU keeps those its C++
GEMV decodes (`CPU_PACKED_TYPES`; a host where it does not build dequantizes, which the router cannot
see); older CUDA dequantizes at load.
`PACKED_TENSOR` names the tensors a packed device holds as blocks: the projections of attention and
MLP (experts, stacked, shared experts and routers too) and an untied head, as the loader's GGUF
layers take them. Trade-off: the router judges by GGUF names, not by the model's modules it cannot
import.
"""

from __future__ import annotations

import re

from workers.contract.capability import Capability

GGUF_PACKED, GGUF_DEQUANTIZED = "packed", "dequantized"
FIRST_PACKED_CUDA = Capability(7, 0)  # Triton's oldest CUDA target
# the types kernels_local/gguf_linear decodes (its `TYPES`; a test holds the two equal)
PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# the types kernels_local/gguf_linear's CPU kernel decodes (cpu.py `TYPES`; a test holds the two equal)
CPU_PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
# `--gguf-activations`: the CPU GEMV's activation rows as given, or rounded to 8 bits per 256 inputs as
# llama.cpp rounds them (kernels_local/gguf_linear/cpu.py); every other path computes them exact
GGUF_EXACT, GGUF_INT8 = "exact", "int8"
GGUF_ACTIVATIONS = (GGUF_EXACT, GGUF_INT8)
PACKED_TENSOR = re.compile(
    r"^(output|blk\.\d+\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down)(_shexp|_exps)?|ffn_gate_inp(_shexp)?))\.weight$")


def gguf_kind(device_type: str, capability=None) -> str:
    """`packed` on the CPU, on CUDA from sm_70 and on ROCm, else `dequantized`."""
    cap = Capability.parse_optional(capability)
    if device_type in ("rocm", "cpu") or (device_type == "cuda" and cap is not None and cap >= FIRST_PACKED_CUDA):
        return GGUF_PACKED
    return GGUF_DEQUANTIZED


def packed_types(device_type: str, capability=None) -> tuple[str, ...]:
    """The tensor types a device keeps packed (none where it dequantizes at load)."""
    if gguf_kind(device_type, capability) != GGUF_PACKED:
        return ()
    return CPU_PACKED_TYPES if device_type == "cpu" else PACKED_TYPES
