"""How a worker runs a GGUF file's tensors, and why (`/capability` `model.gguf`, `/workers`).

Design: the per-device rule of the format (`gguf_rule`), one answer with its reason, as for the
other quantized formats. CUDA from sm_70 and ROCm keep the blocks packed: the loader holds each
linear layer's tensors of a `PACKED_TYPES` type as the file's bytes (workers/gguf/packed.py) and the
Triton GEMV (decode) and GEMM (prefill) of kernels_local/gguf_linear decode them in registers. The
CPU keeps the types its C++ GEMV decodes packed (measured against the dequantized matmuls:
docs/benchmarks.md "GGUF on the CPU"), where that kernel builds. Below sm_70 Triton does not target
the device: it dequantizes at load (workers/gguf/weights.py, exact against gguf-py), as does a CPU
without the kernel. The description reads the model as loaded: how many layers hold
blocks, which were dequantized and why (embeddings, norms, a tied head off the CPU, types no kernel
decodes, a kernel that failed its self-test here), the file's tensors by type and the bytes held beside the
file's. Trade-off: reading the tensor table costs a header parse per description (memory-mapped, no
tensor data read), for a description that never goes stale.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.contract import Capability, parse_token
from workers.contract.defaults import NO_GGUF_EXPERTS, NO_GGUF_LAYER
from workers.contract.gguf_rule import GGUF_EXACT, GGUF_INT8, GGUF_PACKED, PACKED_TYPES, gguf_kind, packed_types
from workers.gguf.experts import GGUFExperts
from workers.gguf.files import open_readers
from workers.gguf.linear import GGUFLinear
from workers.gguf.prepare import pointed_files

PACKED = "packed"
DEQUANTIZED = "dequantized"
KERNEL = "kernels_local/gguf_linear"


@dataclass(frozen=True)
class GGUFRule:
    """How one device runs GGUF blocks: `packed` (the kernel decodes them) or `dequantized` at load."""

    execution: str
    reason: str
    kernel: str | None = None
    types: tuple[str, ...] = ()  # the tensor types kept packed

    def to_dict(self) -> dict:
        return {"execution": self.execution, "kernel": self.kernel, "reason": self.reason, "types": list(self.types)}


def _where(device_type: str, capability: Capability | None) -> str:
    if device_type == "cuda" and capability is not None:
        return f"sm_{capability.major}{capability.minor}"
    return {"rocm": "ROCm", "cpu": "CPU"}.get(device_type, device_type)


def gguf_rule(device_type: str, capability=None) -> GGUFRule:
    """The GGUF rule for a device (`cuda` | `rocm` | `cpu`, its capability where it has one)."""
    cap = Capability.parse_optional(capability)
    where = _where(device_type, cap)
    if device_type == "cpu":
        return _cpu_rule()
    if gguf_kind(device_type, cap) == GGUF_PACKED:
        return GGUFRule(PACKED, f"{where}: blocks kept packed, decoded in registers by {KERNEL}'s Triton GEMV "
                                "(decode) and GEMM (prefill) for the 32-element, K- and IQ4 block families",
                        KERNEL, packed_types(device_type, cap))
    return GGUFRule(DEQUANTIZED, f"{where}: Triton does not target CUDA below sm_70; blocks dequantized at "
                                 "load, a cuBLAS matmul")


def _cpu_rule() -> GGUFRule:
    """The CPU's rule: packed where the C++ GEMV loads (built here once per host, now if not yet)."""
    from kernels_local.gguf_linear import cpu

    types = packed_types("cpu")
    state = cpu.KERNEL.load()
    if not state.available:
        return GGUFRule(DEQUANTIZED, f"CPU: blocks dequantized at load, a float matmul: {state.reason}")
    return GGUFRule(PACKED, f"CPU: {', '.join(types)} blocks kept packed, decoded in registers by {KERNEL}'s "
                            f"{state.reason} (decode, fewer than {cpu.GEMV_MAX_M} rows: it reads 0.14-0.27x the "
                            "bytes of the dequantized float32 matmul it beats there); a prompt's rows through torch's "
                            "matmul on panels dequantized per call; other types dequantized at load", KERNEL, types)


def _device(device: str, capability) -> tuple[str, Capability | None]:
    """(`cuda` | `rocm` | `cpu`, capability) of a worker's device token (`sm_86`, `gfx942`, `cuda`, `cpu`)."""
    if device in ("cuda", "rocm", "cpu"):
        return device, Capability.parse_optional(capability)
    try:
        kind, cap = parse_token(device)
    except ValueError:
        return device, Capability.parse_optional(capability)
    return kind, cap if cap is not None else Capability.parse_optional(capability)


def _held(model) -> tuple[list, list]:
    """(GGUF layers and experts layers holding blocks, those dequantized after their kernel failed) of a
    loaded model."""
    layers = [m for m in model.modules() if isinstance(m, (GGUFLinear, GGUFExperts))] if model is not None else []
    return [m for m in layers if m.execution == PACKED], [m for m in layers if m.execution != PACKED]


def _kinds(holding: list) -> str:
    """`N layers: Q4_K n, Q6_K m` and, with experts, `; E experts layers: Q4_K/Q4_K/Q6_K e` (gate/up/down)."""
    linears = Counter(m.gguf_type for m in holding if isinstance(m, GGUFLinear))
    experts = Counter("/".join(m.types) for m in holding if isinstance(m, GGUFExperts))
    text = f"{sum(linears.values())} layers: " + ", ".join(f"{k} {v}" for k, v in sorted(linears.items()))
    if experts:
        text += (f"; {sum(experts.values())} experts layers (gate/up/down), one grouped kernel each: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(experts.items())))
    return text


def _tied(model) -> str:
    """What the description says of the embedding: shared with a packed tied head (workers/gguf/embedding.py)
    or dequantized at load."""
    embedding = getattr(model, "tok_embeddings", None)
    if embedding is not None and getattr(embedding, "qweight", None) is not None:
        return (f"the head tied to the embedding keeps its {embedding.gguf_type} blocks, which the embedding "
                "decodes per lookup; ")
    return "embeddings, a tied head, "


def _activations(holding: list, device_type: str) -> tuple[str, str]:
    """(how the packed layers take their activation rows, what the reason adds) (`--gguf-activations`)."""
    if not any(m.activations == GGUF_INT8 for m in holding):
        return GGUF_EXACT, ""
    if device_type != "cpu":
        return GGUF_EXACT, ("; `--gguf-activations int8` rounds the rows of the CPU's GEMV only: this device's "
                            "kernels take them exact")
    from kernels_local.gguf_linear import cpu

    if not cpu.int8_runs():
        return GGUF_EXACT, ("; `--gguf-activations int8` was asked, but this CPU has no AVX2 for the int8 GEMV: "
                            "the exact one runs")
    return GGUF_INT8, ("; a decode's activation rows are rounded to 8 bits per 256 inputs before the GEMV "
                       "(`--gguf-activations int8`, as llama.cpp rounds them: faster, and the logits no longer "
                       "within 1e-4 of transformers')")


def gguf_execution(model_dir: Path, dtype: torch.dtype, device: str, capability=None, model=None) -> dict | None:
    """What a worker on `device` (its arch token or type) holding `model` in `dtype` does with the GGUF
    file(s) `model_dir` stands for, and the device's rule; None when `model_dir` is no prepared GGUF directory.
    Without `model`, what the loader does on that device before any kernel ran."""
    files = pointed_files(model_dir)
    if files is None:
        return None
    tensors = [t for reader in open_readers(files) for t in reader.tensors]
    types = Counter(t.tensor_type.name for t in tensors)
    packed = sum(int(t.n_bytes) for t in tensors)
    size = torch.empty((), dtype=dtype).element_size()
    name = str(dtype).removeprefix("torch.")
    rule = gguf_rule(*_device(device, capability))
    holding, fell_back = _held(model)
    elements = sum(int(t.n_elements) for t in tensors)
    resident = (elements - sum(m.elements for m in holding)) * size
    resident += sum(m.nbytes() for m in holding)
    out = {"types": dict(sorted(types.items())), "rule": rule.to_dict(), "packed_bytes": packed,
           "resident_bytes": resident, "packed_layers": len(holding), "dequantized_layers": len(fell_back)}
    if holding:
        activations, why = _activations(holding, _device(device, capability)[0])
        return {**out, "activations": activations,
                "execution": f"packed ({_kinds(holding)}); the rest dequantized at load to {name}",
                "reason": f"{rule.reason}; {_tied(model)}norms and tensors of types the kernels do not decode are "
                          f"dequantized at load, exactly as gguf-py does{why}"}
    if fell_back:
        why = next((m.fallback_reason for m in fell_back if m.fallback_reason), "its kernel failed on this device")
        reason = (f"{rule.reason}; but the packed layers' kernel failed its self-test on this device, so their "
                  f"blocks were dequantized to {name}: {why}")
    elif rule.execution == PACKED and model is not None:
        reason = (f"{rule.reason}; no linear layer of this file is stored in a type the kernels decode "
                  f"({', '.join(rule.types or PACKED_TYPES)}), so each tensor is dequantized at load, exactly as "
                  "gguf-py does")
    else:
        reason = f"{rule.reason}; exactly as gguf-py does, and the layers run in {name}"
    return {**out, "execution": f"dequantized at load to {name}", "reason": reason}


def gguf_layer_unused(model) -> dict[str, str]:
    """{"GGUFLinear": why, "GGUFExperts": why} for the GGUF layer kinds `model` holds no blocks in (its
    preflight compiles no kernel of theirs)."""
    held = _held(model)[0]
    unused = {} if any(isinstance(m, GGUFLinear) for m in held) else {"GGUFLinear": NO_GGUF_LAYER}
    return unused | ({} if any(isinstance(m, GGUFExperts) for m in held) else {"GGUFExperts": NO_GGUF_EXPERTS})
