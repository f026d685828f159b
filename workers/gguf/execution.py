"""How a worker runs a GGUF file's tensors, and why (`/capability` `model.gguf`, `/workers`).

Design: the per-device rule of the format (`gguf_rule`), one answer with its reason, as for the
other quantized formats. CUDA from sm_70 and ROCm keep the blocks packed: the Triton GEMV (decode)
and GEMM (prefill) of kernels_local/gguf_linear decode each block in registers, so a layer holds
its file's bytes instead of 16-bit weights. Below sm_70 Triton does not target the device, and the
CPU has no GGUF kernel measured against the dequantized bf16 matmul (llama.cpp's CPU path is the
bar): both dequantize at load. The description reports the rule and what the loader did: today the
loader dequantizes every block at load (workers/gguf/weights.py, exact against gguf-py), on every
device, since no model layer holds GGUF blocks yet; the rule says which devices a packed layer will
run on. It counts the file's tensors by type and gives their packed bytes beside the bytes the
worker holds. Trade-off: reading the tensor table costs a header parse per start (memory-mapped, no
tensor data read), for a description that never goes stale.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.contract import Capability, parse_token
from workers.gguf.files import open_readers
from workers.gguf.prepare import pointed_files

PACKED = "packed"
DEQUANTIZED = "dequantized"
KERNEL = "kernels_local/gguf_linear"
FIRST_PACKED_CUDA = Capability(7, 0)  # Triton's oldest CUDA target


@dataclass(frozen=True)
class GGUFRule:
    """How one device runs GGUF blocks: `packed` (the kernel decodes them) or `dequantized` at load."""

    execution: str
    reason: str
    kernel: str | None = None

    def to_dict(self) -> dict:
        return {"execution": self.execution, "kernel": self.kernel, "reason": self.reason}


def _where(device_type: str, capability: Capability | None) -> str:
    if device_type == "cuda" and capability is not None:
        return f"sm_{capability.major}{capability.minor}"
    return {"rocm": "ROCm", "cpu": "CPU"}.get(device_type, device_type)


def gguf_rule(device_type: str, capability=None) -> GGUFRule:
    """The GGUF rule for a device (`cuda` | `rocm` | `cpu`, its capability where it has one)."""
    cap = Capability.parse_optional(capability)
    where = _where(device_type, cap)
    if device_type == "rocm" or (device_type == "cuda" and cap is not None and cap >= FIRST_PACKED_CUDA):
        return GGUFRule(PACKED, f"{where}: blocks kept packed, decoded in registers by {KERNEL}'s Triton GEMV "
                                "(decode) and GEMM (prefill) for the 32-element, K- and IQ4 block families",
                        KERNEL)
    if device_type == "cuda":
        return GGUFRule(DEQUANTIZED, f"{where}: Triton does not target CUDA below sm_70; blocks dequantized at "
                                     "load, a cuBLAS matmul")
    return GGUFRule(DEQUANTIZED, f"{where}: blocks dequantized at load: no measured CPU kernel on GGUF blocks "
                                 "beats the dequantized bf16 matmul here yet (llama.cpp's CPU path is the bar)")


def _device(device: str, capability) -> tuple[str, Capability | None]:
    """(`cuda` | `rocm` | `cpu`, capability) of a worker's device token (`sm_86`, `gfx942`, `cuda`, `cpu`)."""
    if device in ("cuda", "rocm", "cpu"):
        return device, Capability.parse_optional(capability)
    try:
        kind, cap = parse_token(device)
    except ValueError:
        return device, Capability.parse_optional(capability)
    return kind, cap if cap is not None else Capability.parse_optional(capability)


def gguf_execution(model_dir: Path, dtype: torch.dtype, device: str, capability=None) -> dict | None:
    """What a worker on `device` (its arch token or type) holding the model in `dtype` does with the GGUF
    file(s) `model_dir` stands for, and the device's rule; None when `model_dir` is no prepared GGUF directory."""
    files = pointed_files(model_dir)
    if files is None:
        return None
    tensors = [t for reader in open_readers(files) for t in reader.tensors]
    types = Counter(t.tensor_type.name for t in tensors)
    packed = sum(int(t.n_bytes) for t in tensors)
    resident = sum(int(t.n_elements) for t in tensors) * torch.empty((), dtype=dtype).element_size()
    name = str(dtype).removeprefix("torch.")
    rule = gguf_rule(*_device(device, capability))
    if rule.execution == PACKED:
        reason = (f"{rule.reason}; the loader does not hold GGUF blocks in the model's layers yet, so each block "
                  f"is dequantized once at load, exactly as gguf-py does, and the layers run in {name}")
    else:
        reason = f"{rule.reason}; exactly as gguf-py does, and the layers run in {name}"
    return {"types": dict(sorted(types.items())), "execution": f"dequantized at load to {name}", "reason": reason,
            "rule": rule.to_dict(), "packed_bytes": packed, "resident_bytes": resident}
