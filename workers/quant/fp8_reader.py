"""Reading an fp8 checkpoint: its fp8 tensors onto our layers, as stored, through the family's map.

Design: `bind` walks the family's weight map: every Hugging Face linear weight the config
quantizes that lands on one of our `nn.Linear` modules (whole, or a part of fused q/k/v or
gate/up) becomes a target with its scheme; its tensors reach `to_ours` untouched (`claims`), which
checks dtypes and shapes, puts every scale in `e4m3`'s grouped layout and concatenates a fused
module's parts in order, and `install` swaps those modules for `Fp8CheckpointLinear`. Experts
stored per expert and projection (Qwen3-MoE, Mixtral) are stacked into an `Fp8FusedMoE`; quantized
tensors the map cannot place (gpt-oss's stacked experts) are refused by name. Where static input
scales of fused parts or experts differ, the largest is taken (as vLLM does) and the notes say so.
Trade-off: the fused layout turns a per-tensor scale into one copy per row."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from workers.quant.checkpoint import ModelMap
from workers.quant.experts import Fp8FusedMoE
from workers.quant.linear import Fp8CheckpointLinear
from workers.quant.scheme import Fp8Scheme, QuantConfig, UnsupportedQuantizationError

logger = logging.getLogger(__name__)

SCALE_LEAVES = ("weight_scale", "weight_scale_inv", "input_scale", "weight_zero_point", "input_zero_point")


class QuantizedTensorError(ValueError):
    """A quantized layer's tensors are not what its scheme stores (dtype, shape, a scale missing)."""


@dataclass(frozen=True)
class _Target:
    hf: str  # the checkpoint's module, `model.layers.0.self_attn.q_proj`
    ours: str  # our module, `layers.0.attention.wqkv`
    part: int | None  # its place in our fused module (None: the whole module)
    scheme: Fp8Scheme
    shape: tuple[int, int]  # [out, in] of its weight
    expert: int | None = None  # an expert's projection: `ours` is the stacked tensor (`...experts.w_gate_up`)


@dataclass(frozen=True)
class _Module:
    """One of our modules as `install` builds it."""

    scheme: Fp8Scheme
    out_features: int
    in_features: int
    group_n: int
    group_k: int
    scale_shape: tuple[int, int]


class QuantizedCheckpoint:
    def __init__(self, quant: QuantConfig, model_map: ModelMap) -> None:
        self.quant, self.map = quant, model_map
        self.targets: dict[str, _Target] = {}
        self.modules: dict[str, _Module] = {}
        self.expert_modules: dict[str, dict[str, _Module]] = {}  # FusedMoE -> {"w_gate_up" | "w_down": stacked}
        self.notes: list[str] = list(quant.notes)

    def bind(self, model: nn.Module, expected: dict[str, tuple[int, ...]]) -> None:
        """Find the quantized targets among the HF tensors `expected` (name -> shape) of `model`."""
        for hf_name, shape in expected.items():
            mapped = self.map.map_name(hf_name) if hf_name.endswith(".weight") and len(shape) == 2 else None
            if mapped is None or not (mapped[1] is None or isinstance(mapped[1], (int, tuple))):
                continue  # not a linear weight of ours (layouts)
            hf, (ours, part) = hf_name.removesuffix(".weight"), mapped
            if isinstance(part, tuple):  # expert `e`'s projection, stacked into `FusedMoE.w_gate_up` / `w_down`
                if type(model.get_submodule(ours.rpartition(".")[0])) is not self.map.experts:
                    continue
                scheme = self.quant.scheme_for(hf)
                if scheme is not None:
                    self.targets[hf] = _Target(hf, ours, part[2], scheme, tuple(shape), expert=part[1])
                continue
            ours = ours.removesuffix(".weight")
            if not mapped[0].endswith(".weight") or type(model.get_submodule(ours)) is not nn.Linear:
                continue
            scheme = self.quant.scheme_for(hf)
            if scheme is not None:
                self.targets[hf] = _Target(hf, ours, part, scheme, tuple(shape))

    def claims(self, name: str) -> bool:
        """Whether the loader hands tensor `name` to `to_ours` as stored (a target's weight and scales)."""
        hf, _, leaf = name.rpartition(".")
        if hf in self.targets:
            return leaf == "weight" or leaf in SCALE_LEAVES
        if leaf in SCALE_LEAVES:  # quantized, but not onto a linear layer of ours
            raise UnsupportedQuantizationError(
                f"Unsupported quantized tensor `{name}`: `{hf}` is not a linear layer hetserve runs in fp8 "
                f"(supported: the linear layers the family maps onto `nn.Linear`, and experts stored one tensor per "
                f"expert and projection)")
        return False

    def covers(self, hf_name: str) -> bool:
        """Whether an expected HF tensor is read by `to_ours` (a target's weight)."""
        return hf_name.endswith(".weight") and hf_name.removesuffix(".weight") in self.targets

    # -- stored tensors -> ours ------------------------------------------------------------------

    def _rows(self, t: _Target, stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(bytes [N, K], scales in the grouped layout, group_n, group_k) of one target, checked."""
        n, k = t.shape
        w = stored[t.hf + ".weight"]
        if tuple(w.shape) != t.shape:
            raise QuantizedTensorError(f"`{t.hf}.weight` has shape {tuple(w.shape)}; the config expects {t.shape}")
        if w.dtype != torch.float8_e4m3fn:
            raise QuantizedTensorError(f"`{t.hf}.weight` is `{w.dtype}`; its scheme ({t.scheme.describe()}) stores "
                                       "`torch.float8_e4m3fn`")
        name = f"{t.hf}.{t.scheme.scale_name}"
        if name not in stored:
            raise QuantizedTensorError(f"`{t.hf}` is quantized ({t.scheme.describe()}) "
                                       f"but the checkpoint has no `{name}`")
        for zp in ("weight_zero_point", "input_zero_point"):
            if f"{t.hf}.{zp}" in stored and bool(stored[f"{t.hf}.{zp}"].to(torch.float32).ne(0).any()):
                raise QuantizedTensorError(f"`{t.hf}.{zp}` is not zero: asymmetric fp8 is not supported")
        s = stored[name].to(torch.float32)  # exact: fp32, or a bf16/fp16 scale widened
        if t.scheme.weights == "block":
            bn, bk = t.scheme.block
            want = (-(-n // bn), -(-k // bk))
            gn, gk = bn, bk
        else:
            want, gn, gk = (n, 1), 1, k
            s = s.reshape(1, 1).expand(n, 1).clone() if t.scheme.weights == "tensor" and s.numel() == 1 else s
        if s.numel() != want[0] * want[1]:
            raise QuantizedTensorError(f"`{name}` has shape {tuple(s.shape)}; a [{n}, {k}] weight with "
                                       f"{t.scheme.weights} scales stores {list(want)}")
        return w, s.reshape(want), gn, gk

    def _fuse(self, ours: str, parts: list[_Target], stored: dict[str, torch.Tensor]):
        """(bytes, scales, group_n, group_k) of one fused module from its parts, in order, checked."""
        parts.sort(key=lambda t: t.part or 0)
        schemes = {(t.scheme.weights == "block", t.scheme.activations) for t in parts}
        if len(schemes) > 1:
            raise UnsupportedQuantizationError(
                f"Unsupported fused layer `{ours}`: its parts {', '.join(f'`{t.hf}`' for t in parts)} have "
                f"different fp8 schemes. Supported: one scheme for all parts of q/k/v and of gate/up")
        rows = [self._rows(t, stored) for t in parts]
        gn, gk = rows[0][2], rows[0][3]
        if gn > 1 and any(t.shape[0] % gn for t in parts[:-1]):  # a part does not start on a block
            rows = [(w, s.repeat_interleave(gn, dim=0)[: w.shape[0]], 1, gk) for w, s, _, _ in rows]
            gn = 1
        return torch.cat([w for w, *_ in rows]), torch.cat([s for _, s, *_ in rows]), gn, gk

    def to_ours(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state-dict entries (`<module>.qweight`, `.weight_scale`, `.input_scale`; experts'
        `<experts>.w_gate_up_q`, `_scale`, `.input_scale`) from the stored tensors."""
        by_module: dict[str, list[_Target]] = {}
        by_expert: dict[str, dict[int, list[_Target]]] = {}
        for t in self.targets.values():
            if t.expert is None:
                by_module.setdefault(t.ours, []).append(t)
            else:
                by_expert.setdefault(t.ours, {}).setdefault(t.expert, []).append(t)
        out: dict[str, torch.Tensor] = {}
        for ours, parts in by_module.items():
            out[f"{ours}.qweight"], out[f"{ours}.weight_scale"], gn, gk = self._fuse(ours, parts, stored)
            if parts[0].scheme.activations == "static_tensor":
                out[f"{ours}.input_scale"] = self._input_scale(ours, parts, stored)
            scale = out[f"{ours}.weight_scale"]
            self.modules[ours] = _Module(parts[0].scheme, out[f"{ours}.qweight"].shape[0], parts[0].shape[1], gn, gk,
                                         tuple(scale.shape))
        for ours, experts in by_expert.items():
            out |= self._stack(ours, experts, stored)
        return out

    def _stack(self, ours: str, experts: dict[int, list[_Target]], stored: dict[str, torch.Tensor]):
        """One stacked expert tensor (`...experts.w_gate_up`): each expert's parts fused, then stacked."""
        module, _, param = ours.rpartition(".")
        count = self.map.num_experts
        if sorted(experts) != list(range(count)):
            missing = sorted(set(range(count)) - set(experts))
            raise UnsupportedQuantizationError(
                f"Unsupported fp8 experts `{ours}`: experts {missing[:8]} are not quantized while others are. "
                "Supported: all experts of a layer in one fp8 scheme")
        fused = [self._fuse(f"{ours}[{e}]", experts[e], stored) for e in range(count)]
        groups = {(gn, gk) for *_, gn, gk in fused}
        if len(groups) > 1:  # block scales on some experts' rows, per-row on others: cannot happen per config
            raise QuantizedTensorError(f"`{ours}`: experts' scale groups differ ({sorted(groups)})")
        (gn, gk), first = groups.pop(), experts[0][0]
        out = {f"{module}.{param}_q": torch.stack([q for q, *_ in fused]),
               f"{module}.{param}_scale": torch.stack([s for _, s, *_ in fused])}
        if first.scheme.activations == "static_tensor":
            parts = [t for e in range(count) for t in experts[e]]
            out[f"{module}.{param}_input_scale"] = self._input_scale(ours, parts, stored)
        self.expert_modules.setdefault(module, {})[param] = _Module(first.scheme, fused[0][0].shape[0],
                                                                    first.shape[1], gn, gk,
                                                                    tuple(out[f"{module}.{param}_scale"].shape))
        return out

    def _input_scale(self, ours: str, parts: list[_Target], stored: dict[str, torch.Tensor]) -> torch.Tensor:
        values = []
        for t in parts:
            name = f"{t.hf}.input_scale"
            if name not in stored or stored[name].numel() != 1:
                raise QuantizedTensorError(f"`{t.hf}` has static activations but `{name}` is "
                                           f"{'missing' if name not in stored else list(stored[name].shape)}; "
                                           "one value per tensor is stored")
            values.append(stored[name].to(torch.float32).reshape(()))
        top = torch.stack(values).max()
        if any(v != top for v in values):
            shown = ", ".join(f"{float(v):.6g}" for v in values[:4])
            shown += f" and {len(values) - 4} more" if len(values) > 4 else ""
            self.notes.append(f"`{ours}`: its parts' static input scales differ ({shown}); "
                              f"the largest ({float(top):.6g}) quantizes the shared input")
        return top.clone()

    def install(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> int:
        """Swap each quantized module of `model` (built on meta) for an `Fp8CheckpointLinear` or, for
        experts, an `Fp8FusedMoE`; how many. `state_dict` (from `to_ours`) gets the experts' static
        input scales as the one buffer the layer holds."""
        for ours, spec in self.modules.items():
            parent_name, _, attr = ours.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, attr)
            layer = Fp8CheckpointLinear(spec.in_features, spec.out_features, spec.scheme, spec.scale_shape,
                                        spec.group_n, spec.group_k, old.bias is not None, dtype=old.weight.dtype,
                                        device="meta")  # fmt: skip
            setattr(parent, attr, layer)
        for module, params in self.expert_modules.items():
            setattr(*self._experts(model, module, params, state_dict))
        for note in self.notes:
            logger.info("fp8 checkpoint: %s", note)
        return len(self.modules) + len(self.expert_modules)

    def _experts(self, model: nn.Module, module: str, params: dict[str, _Module], state_dict) -> tuple:
        """(parent, attribute, `Fp8FusedMoE`) replacing the `FusedMoE` at `module`."""
        if set(params) != {"w_gate_up", "w_down"} or len({p.scheme.activations for p in params.values()}) > 1:
            raise UnsupportedQuantizationError(
                f"Unsupported fp8 experts `{module}`: {', '.join(sorted(params))} quantized "
                f"({', '.join(p.scheme.describe() for p in params.values())}). Supported: gate, up and down "
                "projections of every expert in one fp8 scheme")
        parent_name, _, attr = module.rpartition(".")
        old = model.get_submodule(module)
        gu, down = params["w_gate_up"], params["w_down"]
        layer = Fp8FusedMoE(old.num_experts, down.out_features, down.in_features, gu.scheme,
                            (gu.group_n, gu.group_k), (down.group_n, down.group_k), old.b_gate_up is not None,
                            old.activation, old.alpha, old.limit, dtype=old.w_gate_up.dtype, device="meta")  # fmt: skip
        if state_dict is not None and gu.scheme.activations == "static_tensor":
            state_dict[f"{module}.input_scale"] = torch.stack([state_dict.pop(f"{module}.{p}_input_scale").reshape(())
                                                               for p in ("w_gate_up", "w_down")])  # fmt: skip
        return model.get_submodule(parent_name), attr, layer

    def describe(self) -> dict:
        """The checkpoint's quantization and what reading it decided, for `/workers`."""
        return {**self.quant.describe(), "notes": list(self.notes), "quantized_modules": len(self.modules),
                "quantized_experts": len(self.expert_modules)}
