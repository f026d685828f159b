"""`GGUFLinear`: a linear layer holding a GGUF tensor's blocks as the file stores them.

Design: `qweight` is the tensor's bytes, uint8 [N, K / QK * TYPE_SIZE] (one row of blocks per output,
llama.cpp's own order), with its type `gguf_type`; nothing is repacked, so a layer holds its file's
bytes. The kernel layers (kernels_local/gguf_linear, selected per device through the kernel mapping's
`GGUFLinear` entries) decode the blocks in registers; this class's `forward` is their torch reference:
the blocks decoded bit for bit as gguf-py does (workers/gguf/dequant.py), rounded to the activations'
dtype, an fp32 matmul. A module of ours that fuses several GGUF tensors (q/k/v into `wqkv`, gate/up
into `w_gate_up`) whose types differ, as Q4_K_M's q/k (Q4_K) and v (Q6_K) do, becomes a
`GGUFFusedLinear` of one `GGUFLinear` per run of parts sharing a type, outputs concatenated in order.
`fall_back(reason)` widens the blocks once into a dense weight (`execution` "dequantized"): what a
worker does when the packed kernel fails its self-test on its device. `activations` (`--gguf-activations`,
set on every layer by `set_activations`) tells the CPU's kernel layer whether to round a decode's rows
to 8 bits first. Trade-off: the torch reference
decodes the blocks on every call (a correctness path, not a fast one); where the device has no
kernel the loader dequantizes at load instead and never builds these layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels import use_kernel_forward_from_hub
from torch import nn

from workers.contract.gguf_rule import GGUF_ACTIVATIONS, GGUF_EXACT
from workers.gguf.dequant import BLOCKS, dequantize

PACKED = "packed"
DEQUANTIZED = "dequantized"


def row_bytes(type_name: str, in_features: int) -> int:
    """Bytes of one output's row of `type_name` blocks over `in_features` inputs."""
    qk, size = BLOCKS[type_name]
    return in_features // qk * size


@use_kernel_forward_from_hub("GGUFLinear")
class GGUFLinear(nn.Module):
    """y = x @ W.T + b, W [N, K] the GGUF blocks `qweight` of type `gguf_type` (or `weight` once dequantized).

    Kernel layers read `execution`, `qweight`, `gguf_type`, `bias`, and `weight` when dequantized."""

    def __init__(self, in_features: int, out_features: int, gguf_type: str, *, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta") -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features, self.gguf_type = in_features, out_features, gguf_type
        self.execution = PACKED
        self.activations = GGUF_EXACT  # or int8: the CPU GEMV rounds a decode's rows (`set_activations`)
        self.fallback_reason: str | None = None
        self.register_buffer("qweight", torch.empty(out_features, row_bytes(gguf_type, in_features),
                                                    dtype=torch.uint8, device=device))
        self.register_buffer("weight", None)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None  # fmt: skip

    @property
    def elements(self) -> int:
        """Weight elements the layer holds."""
        return self.in_features * self.out_features

    def dense(self) -> torch.Tensor:
        """The weight [N, K] in fp32, decoded from the blocks exactly as gguf-py does."""
        return dequantize(self.qweight, self.gguf_type, (self.out_features, self.in_features))

    def fall_back(self, reason: str, dtype: torch.dtype | None = None) -> None:
        """Hold the weight dequantized (in the bias's or `dtype`) from now on, with the reason."""
        if self.execution == DEQUANTIZED:
            return
        dtype = dtype or (self.bias.dtype if self.bias is not None else torch.float32)
        self.weight = self.dense().to(dtype)
        self.qweight = None
        self.execution, self.fallback_reason = DEQUANTIZED, reason

    def nbytes(self) -> int:
        held = self.qweight if self.execution == PACKED else self.weight
        return held.numel() * held.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if self.execution == DEQUANTIZED:
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        # the weight decoded in fp32, rounded to x's dtype, an fp32 matmul (the kernels' arithmetic)
        w = self.dense().to(x.dtype).to(torch.float32)
        y = F.linear(x.to(torch.float32), w, None if self.bias is None else self.bias.to(torch.float32))
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={self.gguf_type}, "
                f"bias={self.bias is not None}, execution={self.execution}")


class GGUFFusedLinear(nn.Module):
    """One of our fused modules over GGUF tensors of differing types: a `GGUFLinear` per run of parts
    sharing a type, outputs concatenated in part order, then the fused bias."""

    def __init__(self, in_features: int, runs: list[tuple[str, int]], *, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "meta") -> None:  # fmt: skip
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(rows for _, rows in runs)
        self.parts = nn.ModuleList(GGUFLinear(in_features, rows, t, dtype=dtype, device=device) for t, rows in runs)
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device),
                                 requires_grad=False) if bias else None  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([part(x) for part in self.parts], dim=-1)  # [..., N]
        return y if self.bias is None else y + self.bias.to(y.dtype)


def type_runs(parts: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """(type, rows) of each run of consecutive parts sharing a type, in order."""
    runs: list[tuple[str, int]] = []
    for type_name, rows in parts:
        if runs and runs[-1][0] == type_name:
            runs[-1] = (type_name, runs[-1][1] + rows)
        else:
            runs.append((type_name, rows))
    return runs


def set_activations(model: nn.Module, mode: str) -> int:
    """Set every GGUF layer's (and GGUF experts layer's) `activations` to `mode` (one of `GGUF_ACTIVATIONS`);
    how many layers it set."""
    if mode not in GGUF_ACTIVATIONS:
        raise ValueError(f"`--gguf-activations {mode}` is not accepted. Accepted: {', '.join(GGUF_ACTIVATIONS)}")
    kinds = ("GGUFLinear", "GGUFExperts")
    layers = [m for m in model.modules() if getattr(type(m), "kernel_layer_name", None) in kinds]
    for layer in layers:
        layer.activations = mode
    return len(layers)
