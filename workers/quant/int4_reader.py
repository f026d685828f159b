"""Reading a 4-bit checkpoint (GPTQ, AWQ, compressed-tensors pack-quantized) for this device's execution.

Design: driven by the loader through the same calls as the fp8 reader (workers/quant/checkpoint.py);
`claims` takes every 4-bit leaf of a layer the config quantizes (and the zero `bias` AutoGPTQ
stores). The execution comes from the device rule for the device the loader names (a simulated GPU
loads onto the CPU yet keeps its GPU's execution). `to_ours` checks each layer against its
format's reference (int4_pack.py); where the device keeps the 4 bits it moves the layer exactly
into the run-time layout and concatenates a fused module's parts, and `install` swaps in
`Int4CheckpointLinear`; where it does not, the reference weights take the family's own map as an
unquantized checkpoint's would. Experts and fused modules with differing act-orders are
dequantized on every device (the notes say so); the named errors: docs/quantization-int4.md.
Trade-off: each layer's reference weight is formed once at load to check it, one layer at a time,
which costs that layer's widened bytes transiently."""
from __future__ import annotations

import logging

import torch
from torch import nn

from workers.quant.checkpoint import ModelMap
from workers.quant.int4_linear import Int4CheckpointLinear, fusable, fuse_runtime, to_runtime
from workers.quant.int4_methods import INT4_DEQUANTIZED, int4_execution
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
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Int4Checkpoint:
    def __init__(self, quant: Int4Config, model_map: ModelMap, device_type: str,
                 capability: tuple[int, int] | None) -> None:  # fmt: skip
        self.quant, self.map = quant, model_map
        self.device_type, self.capability = device_type, capability
        self.execution = int4_execution(self.device_type, self.capability)
        self.expected: dict[str, tuple[int, ...]] = {}
        self.dtype = torch.float32
        self.layers: dict[str, Int4Scheme] = {}  # HF module -> scheme, for each module whose packed tensor was read
        self.linear: dict[str, tuple[str, int | None]] = {}  # HF module -> (our nn.Linear, its part), from `bind`
        self.modules: dict[str, dict] = {}  # our module -> how `install` builds its Int4CheckpointLinear
        self.stored_bytes = self.weight_bytes = self.bf16_bytes = 0
        self.notes: list[str] = list(quant.notes)

    def bind(self, model: nn.Module, expected: dict[str, tuple[int, ...]]) -> None:
        """Note the HF tensors `expected` (name -> shape) of `model`, the model dtype and which HF
        modules land on one of our `nn.Linear` modules."""
        self.expected, self.dtype = dict(expected), model.dtype
        for hf_name, shape in expected.items():
            mapped = self.map.map_name(hf_name) if hf_name.endswith(".weight") and len(shape) == 2 else None
            if (mapped is None or not mapped[0].endswith(".weight")
                    or not (mapped[1] is None or isinstance(mapped[1], int))):
                continue  # not a linear weight of ours (experts, layouts)
            ours = mapped[0].removesuffix(".weight")
            if type(model.get_submodule(ours)) is nn.Linear:
                self.linear[hf_name.removesuffix(".weight")] = (ours, mapped[1])

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
                    f"Unsupported 4-bit tensor `{name}`: the `{self.quant.method}` config leaves `{module}` "
                    f"unquantized "
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
            mapped = self.map.map_name(hf) if hf.endswith(".weight") else None
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

    def _leaves(self, module: str, scheme: Int4Scheme, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {leaf: stored[f"{module}.{leaf}"] for leaf in scheme.leaves if f"{module}.{leaf}" in stored}

    def _packed_modules(self, stored: dict[str, torch.Tensor]) -> dict[str, list[tuple[int, str]]]:
        """Our nn.Linear modules held in 4 bits on this device: module -> [(part, HF module)], in order."""
        by_ours: dict[str, list[tuple[int, str]]] = {}
        if not self.execution.packed:
            return by_ours
        for module in self.layers:
            if module in self.linear:
                ours, part = self.linear[module]
                by_ours.setdefault(ours, []).append((part or 0, module))
        return {ours: sorted(parts) for ours, parts in by_ours.items()}

    def to_ours(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state-dict entries of the 4-bit layers: each module's run-time layout (`<module>.qweight`,
        `.scales`, `.zeros`, `.g_idx`) where the device keeps 4 bits, else the dequantized weights, fused
        by the family's map."""
        self._check_fused()
        for name, t in stored.items():  # AutoGPTQ's bias on a layer without one: must be zero
            if name.endswith(".bias") and bool(t.ne(0).any()):
                raise Int4TensorError(f"`{name}` is not zero but the model's `{name.rpartition('.')[0]}` has no bias. "
                                      "Supported: a zero bias (as AutoGPTQ writes) or none")
        unused = sorted(n for n in stored if n.rpartition(".")[0] not in self.layers and not n.endswith(".bias"))
        if unused:
            raise Int4TensorError(f"4-bit tensors without their packed weight: "
                                  f"{', '.join(f'`{n}`' for n in unused[:8])}")
        # 1. every layer checked against its reference (shapes, zero points, g_idx), one at a time (a
        #    layer's widened weight is transient); kept in the model dtype only where it stays widened
        groups = self._packed_modules(stored)
        packed = {m for parts in groups.values() for _, m in parts}
        widened: dict[str, torch.Tensor] = {}
        elements = 0
        for module, scheme in self.layers.items():
            w = self._dequantize(module, scheme, stored)
            elements += w.numel()
            if module not in packed:
                widened[module] = w.to(self.dtype)
        self.bf16_bytes = 2 * elements  # the same layers unquantized, in bf16
        # 2. our modules that keep 4 bits: parts in the run-time layout, fused along the outputs
        out: dict[str, torch.Tensor] = {}
        for ours, parts in groups.items():
            runtimes = [to_runtime(self.layers[m], self._leaves(m, self.layers[m], stored)) for _, m in parts]
            why = fusable(runtimes)
            if why is not None:
                self.notes.append(f"`{ours}`: its parts' 4-bit layouts cannot share one layer ({why}); "
                                  "dequantized at load")
                self.modules[ours] = {"execution": INT4_DEQUANTIZED}
                widened |= {m: self._dequantize(m, self.layers[m], stored).to(self.dtype) for _, m in parts}
                continue
            rt = fuse_runtime(runtimes)
            out |= {f"{ours}.{k}": rt[k] for k in ("qweight", "scales", "zeros", "g_idx") if rt[k] is not None}
            self.modules[ours] = {"execution": self.execution.kind, "in_features": rt["in_features"],
                                  "groups": rt["scales"].shape[0], "group_size": rt["group_size"],
                                  "scale_dtype": rt["scales"].dtype, "act_order": rt["g_idx"] is not None}
        # 3. the rest as the reference weights in the model dtype, through the family's map
        hf = {module + ".weight": w for module, w in widened.items()}
        for module in widened:  # a widened nn.Linear is an Int4CheckpointLinear too, holding `weight`
            if module in self.linear:
                self.modules.setdefault(self.linear[module][0], {"execution": INT4_DEQUANTIZED})
        if any(m not in self.linear for m in widened):
            self.notes.append("experts stored in 4 bits have no 4-bit layer: dequantized at load on every device")
        self.stored_bytes = _nbytes(t for n, t in stored.items() if not n.endswith(".bias"))
        self.weight_bytes = _nbytes(out.values()) + _nbytes(hf.values())
        return out | self.map.to_ours(hf)

    def install(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> int:
        """Swap each of our modules the 4-bit layers land on for an `Int4CheckpointLinear` of its
        execution (built on meta; the loader assigns the tensors `to_ours` made); how many."""
        for ours, spec in self.modules.items():
            parent_name, _, attr = ours.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, attr)
            if spec["execution"] == INT4_DEQUANTIZED:
                layer = Int4CheckpointLinear(old.in_features, old.out_features, 0, 0, INT4_DEQUANTIZED,
                                             bias=old.bias is not None, dtype=old.weight.dtype, device="meta")
            else:
                layer = Int4CheckpointLinear(spec["in_features"], old.out_features, spec["groups"], spec["group_size"],
                                             spec["execution"], scale_dtype=spec["scale_dtype"],
                                             act_order=spec["act_order"], bias=old.bias is not None,
                                             dtype=old.weight.dtype, device="meta")  # fmt: skip
            setattr(parent, attr, layer)
        log = logger.warning if self.execution.kind == INT4_DEQUANTIZED else logger.info
        log("%s checkpoint runs %s: %d layers, %d bytes stored -> %d bytes held (%s): %s", self.quant.method,
            self.execution.kind, len(self.layers), self.stored_bytes, self.weight_bytes, self.dtype,
            self.execution.reason)
        for note in self.notes:
            logger.info("4-bit checkpoint: %s", note)
        return len(self.modules)

    def describe(self) -> dict:
        """The checkpoint's quantization, this device's execution with its reason, and the bytes."""
        packed = sum(spec["execution"] != INT4_DEQUANTIZED for spec in self.modules.values())
        return {**self.quant.describe(), "notes": list(self.notes), "quantized_modules": len(self.layers),
                "device": self.device_type, "execution": self.execution.kind, "reason": self.execution.reason,
                "packed_modules": packed, "widened_modules": len(self.modules) - packed,
                "stored_bytes": self.stored_bytes, "weight_bytes": self.weight_bytes,
                "widened_bytes": max(0, self.weight_bytes - self.stored_bytes), "bf16_bytes": self.bf16_bytes,
                "bf16_ratio": round(self.weight_bytes / self.bf16_bytes, 4) if self.bf16_bytes else None}
