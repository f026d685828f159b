"""`--quantize fp8`: a loaded model's projections quantized to e4m3, in the worker's one fp8 convention.

Design: `quantize_model(model, conv)` replaces each projection `nn.Linear` by an `Fp8Linear` with
e4m3 weights and one fp32 scale per output channel; its buffer dtype and the kernels' `NATIVE`
flag both come from `conv`, and activations are quantized per token at run time. A kernelized
model's new layers get this device's `Fp8Linear` kernel through the plan the kernelize step
recorded on the model (`plan.apply(layer)`), so this package imports neither. The token embedding
and, by default, the LM head stay unquantized: the head's error lands directly on the logits, and
with tied embeddings it is the embedding table (`include_lm_head=True` quantizes it too).
Trade-off: the LM head keeps its full-precision bytes (vocab x hidden)."""

from __future__ import annotations

import logging

import torch
from kernels import use_kernel_forward_from_hub
from torch import nn

from workers.quant.fp8_convention import Fp8Convention
from workers.quant.fp8_quantize import dequantize, quantize, quantize_weight_per_channel

logger = logging.getLogger(__name__)

LM_HEAD_NAMES = ("output", "lm_head")


class Fp8KernelMismatchError(RuntimeError):
    """The model's `Fp8Linear` kernel was chosen for a different fp8 convention."""


@use_kernel_forward_from_hub("Fp8Linear")
class Fp8Linear(nn.Module):
    """y = x @ dequant(qweight).T + bias, with per-token activation and per-channel weight scales.

    Kernel layers read `qweight` [N, K] (conv.storage_dtype), `weight_scale` [N] fp32,
    `bias` [N] or None, `fp8_native` and `fp8_fmt`."""

    def __init__(self, in_features: int, out_features: int, conv: Fp8Convention, bias: bool = False, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.convention = conv
        self.register_buffer(
            "qweight", torch.empty(out_features, in_features, dtype=conv.storage_dtype, device=device)
        )
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @property
    def fp8_native(self) -> bool:
        return self.convention.native

    @property
    def fp8_fmt(self) -> str:
        return self.convention.fmt

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, conv: Fp8Convention) -> Fp8Linear:
        w = linear.weight
        layer = cls(w.shape[1], w.shape[0], conv, linear.bias is not None, dtype=w.dtype, device=w.device)
        q, scale = quantize_weight_per_channel(w, conv)  # [N, K] storage dtype, [N] fp32
        layer.qweight.copy_(q)
        layer.weight_scale.copy_(scale)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        k = x.shape[-1]
        xq, sx = quantize(x.reshape(-1, k), self.convention, group_size=k)  # [M, K], [M, 1]
        xd = dequantize(xq, sx, self.convention, group_size=k)  # [M, K] fp32
        wd = dequantize(self.qweight, self.weight_scale, self.convention)  # [N, K] fp32
        y = xd @ wd.t().contiguous()  # [M, N] fp32; [K, N] materialized like torch._scaled_mm on CPU
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"convention={self.convention.name}, storage={self.convention.storage_dtype_name}"
        )


def _targets(model: nn.Module, include_lm_head: bool) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every nn.Linear to swap."""
    out = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if type(child) is nn.Linear and (include_lm_head or name not in LM_HEAD_NAMES):
                out.append((parent, attr))
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.no_grad()
def quantize_model(model: nn.Module, conv: Fp8Convention, *, include_lm_head: bool = False) -> dict:
    """Swap the model's projections for fp8 layers in `conv`; returns a summary."""
    plan = getattr(model, "kernel_plan", None)
    choice = None if plan is None else plan.choices.get("Fp8Linear")
    # 1. the kernel chosen for this device must be of this convention
    if choice is not None and choice.fp8 != conv.name:
        raise Fp8KernelMismatchError(
            f"The `Fp8Linear` kernel chosen for this device (`{choice.variant}`) is built for the fp8 "
            f"convention `{choice.fp8}`, not `{conv.name}`; both must come from the same device decision"
        )
    # 2. swap each projection; the full-precision weight is released as we go
    targets = _targets(model, include_lm_head)
    before = after = 0
    swapped = []
    for parent, attr in targets:
        linear = getattr(parent, attr)
        before += _nbytes([linear.weight])
        layer = Fp8Linear.from_linear(linear, conv)
        after += _nbytes([layer.qweight, layer.weight_scale])
        setattr(parent, attr, layer)
        swapped.append(layer)
    # 3. give the new layers this device's kernel (the plan the kernelize step recorded)
    if plan is not None and swapped:
        for layer in swapped:
            plan.apply(layer)
    skipped = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    summary = {
        "convention": conv.name,
        "storage_dtype": conv.storage_dtype_name,
        "layers": len(swapped),
        "skipped": skipped,
        "weight_bytes_before": before,
        "weight_bytes_after": after,
        "kernel": None if choice is None else choice.to_dict(),
    }
    logger.info(
        "fp8 (%s, %s storage): %d linear layers, weights %d -> %d bytes; kept: %s",
        conv.name, conv.storage_dtype_name, len(swapped), before, after, ", ".join(skipped) or "none",
    )  # fmt: skip
    return summary
