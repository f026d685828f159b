"""Reading a 4-bit checkpoint (GPTQ, AWQ, compressed-tensors pack-quantized): dequantized at load.

Design: the loader drives this reader through the same five calls as the fp8 one
(workers/model/quantized.py): `bind` notes the HF tensors the model expects, `claims` takes every
4-bit leaf of a layer the config quantizes (`qweight`, `qzeros`, `scales`, `g_idx`; `weight_packed`,
`weight_scale`, `weight_shape`, `weight_zero_point`), and the zero `bias` AutoGPTQ stores for layers
that have none, `covers` tells the loader which expected `.weight` those stand for, `to_ours`
dequantizes each layer exactly as its format's reference does (workers/quant/int4_pack.py, in the
scales' dtype, then the model dtype) and hands the weights to the family's own map, so fused q/k/v
and gate/up and stacked experts come out as for an unquantized checkpoint; `install` then has
nothing to swap. A 4-bit leaf on a layer the config leaves alone (`modules_to_not_convert`,
`ignore`), a fused layer with some parts 4-bit and others not, or a layer with its packed tensor
but a missing scale, are named errors. `describe` gives `/workers` the method, the schemes, the
device rule's execution and reason (workers/quant/int4_methods.py) and the bytes: as stored, and as
widened. The trade-off: the widened weights are what the device holds (a 4-bit checkpoint takes its
dequantized twin's memory) until 4-bit kernel layers exist; in exchange every device computes with
the reference weights exactly.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from workers.model.config import ModelConfig
from workers.model.weights import map_name, to_ours
from workers.quant.int4_methods import int4_execution
from workers.quant.int4_pack import (
    Int4TensorError,
    dequantize_awq,
    dequantize_gptq,
    dequantize_pack_quantized,
)
from workers.quant.int4_scheme import LEAVES, Int4Config, Int4Scheme
from workers.quant.scheme import UnsupportedQuantizationError

logger = logging.getLogger(__name__)

ALL_LEAVES = frozenset(leaf for leaves in LEAVES.values() for leaf in leaves)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Int4Checkpoint:
    def __init__(self, quant: Int4Config, config: ModelConfig) -> None:
        self.quant, self.config = quant, config
        self.expected: dict[str, tuple[int, ...]] = {}
        self.dtype = torch.float32
        self.layers: dict[str, Int4Scheme] = {}  # HF module -> scheme, for each module whose packed tensor was read
        self.stored_bytes = self.weight_bytes = 0
        self.notes: list[str] = list(quant.notes)

    def bind(self, model: nn.Module, expected: dict[str, tuple[int, ...]]) -> None:
        """Note the HF tensors `expected` (name -> shape) of `model` and the model dtype."""
        self.expected, self.dtype = dict(expected), model.dtype

    def _scheme(self, module: str) -> Int4Scheme | None:
        return self.quant.scheme_for(module)

    def claims(self, name: str) -> bool:
        """Whether tensor `name` is a 4-bit layer's stored tensor (handed to `to_ours` as stored)."""
        module, _, leaf = name.rpartition(".")
        scheme = self._scheme(module)
        if leaf == "bias" and scheme is not None and name not in self.expected:
            return True  # AutoGPTQ writes a (zero) bias for every layer; checked in `to_ours`
        if leaf not in ALL_LEAVES:
            return False
        if scheme is None or leaf not in scheme.leaves:
            if leaf in ("qweight", "weight_packed", "qzeros", "g_idx", "weight_zero_point"):
                raise UnsupportedQuantizationError(
                    f"Unsupported 4-bit tensor `{name}`: the `{self.quant.method}` config leaves `{module}` unquantized "
                    f"(modules_to_not_convert / ignore: {', '.join(f'`{p}`' for p in self.quant.ignore) or 'none'}). "
                    "Supported: 4-bit tensors only on the layers the config quantizes")
            return False  # a `scales` or `weight_scale` of something else: the loader judges it
        if leaf == scheme.packed:
            self.layers[module] = scheme
        return True

    def covers(self, hf_name: str) -> bool:
        """Whether an expected HF tensor is made by `to_ours` (the weight of a layer stored in 4 bits)."""
        return hf_name.endswith(".weight") and hf_name.removesuffix(".weight") in self.layers

    # -- stored tensors -> ours ------------------------------------------------------------------

    def _dequantize(self, module: str, scheme: Int4Scheme, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        def get(leaf: str, required: bool = True):
            t = stored.get(f"{module}.{leaf}")
            if t is None and required:
                raise Int4TensorError(f"`{module}` is stored in 4 bits ({scheme.describe()}) but the checkpoint has "
                                      f"no `{module}.{leaf}`")
            return t

        if scheme.layout == "gptq":
            w = dequantize_gptq(get("qweight"), get("qzeros"), get("scales"), get("g_idx", False),
                                scheme.group_size, scheme.zero_offset)
        elif scheme.layout == "awq":
            w = dequantize_awq(get("qweight"), get("qzeros"), get("scales"), scheme.group_size)
        else:
            w = dequantize_pack_quantized(get("weight_packed"), get("weight_scale"), get("weight_shape"),
                                          get("weight_zero_point", scheme.zero_points) if scheme.zero_points else None,
                                          scheme.group_size)
        want = self.expected.get(module + ".weight")
        if want is not None and tuple(w.shape) != tuple(want):
            raise Int4TensorError(f"`{module}` dequantizes to shape {tuple(w.shape)}; the config expects {tuple(want)}")
        return w

    def _check_fused(self) -> None:
        """A fused module of ours (q/k/v, gate/up) takes all its parts in 4 bits or none."""
        parts: dict[str, list[str]] = {}
        for hf in self.expected:
            mapped = map_name(hf, self.config) if hf.endswith(".weight") else None
            if mapped is not None and isinstance(mapped[1], int):
                parts.setdefault(mapped[0], []).append(hf)
        for ours, names in parts.items():
            quantized = [n for n in names if self.covers(n)]
            if quantized and len(quantized) != len(names):
                ours, quantized = ours.removesuffix(".weight"), [n.removesuffix(".weight") for n in quantized]
                rest = sorted(n.removesuffix(".weight") for n in names if not self.covers(n))
                raise UnsupportedQuantizationError(
                    f"Unsupported fused layer `{ours}`: {', '.join(f'`{n}`' for n in quantized)} stored in 4 bits but "
                    f"{', '.join(f'`{n}`' for n in rest)} not. Supported: all parts of q/k/v and of gate/up in 4 bits "
                    "or none")

    def to_ours(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state-dict entries of the 4-bit layers: their weights dequantized, fused by the family's map."""
        self._check_fused()
        hf: dict[str, torch.Tensor] = {}
        for module, scheme in self.layers.items():
            hf[module + ".weight"] = self._dequantize(module, scheme, stored).to(self.dtype)
        for name, t in stored.items():  # AutoGPTQ's bias on a layer without one: must be zero
            if name.endswith(".bias") and bool(t.ne(0).any()):
                raise Int4TensorError(f"`{name}` is not zero but the model's `{name.rpartition('.')[0]}` has no bias. "
                                      "Supported: a zero bias (as AutoGPTQ writes) or none")
        unused = sorted(n for n in stored if n.rpartition(".")[0] not in self.layers and not n.endswith(".bias"))
        if unused:
            raise Int4TensorError(f"4-bit tensors without their packed weight: {', '.join(f'`{n}`' for n in unused[:8])}")
        self.stored_bytes = _nbytes(t for n, t in stored.items() if not n.endswith(".bias"))
        self.weight_bytes = _nbytes(hf.values())
        return to_ours(hf, self.config)

    def install(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> int:
        """Nothing to swap: the 4-bit layers are plain linear layers holding their dequantized weights."""
        logger.warning("%s checkpoint dequantized at load: %d layers, %d bytes stored -> %d bytes in %s",
                       self.quant.method, len(self.layers), self.stored_bytes, self.weight_bytes, self.dtype)
        return 0

    def describe(self, device_type: str | None = None, capability: tuple[int, int] | None = None) -> dict:
        """The checkpoint's quantization, its execution (for `device_type`, default every device) and bytes."""
        execution = int4_execution(device_type or "cuda", capability)
        reason = execution.reason if device_type else "every device: 4-bit weights dequantized at load (no 4-bit " \
                                                      "kernel layer yet; widened bytes below)"
        return {**self.quant.describe(), "notes": list(self.notes), "quantized_modules": len(self.layers),
                "execution": execution.kind, "reason": reason, "stored_bytes": self.stored_bytes,
                "weight_bytes": self.weight_bytes, "widened_bytes": max(0, self.weight_bytes - self.stored_bytes)}
