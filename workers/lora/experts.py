"""LoRA on the experts of a mixture-of-experts layer, as PEFT writes it with `target_parameters`.

Design: PEFT wraps the stacked expert parameters of Hugging Face's fused experts
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) in one `ParamWrapper`
each, saved as `...mlp.experts.lora_A.weight` [r*E, in] and `lora_B.weight` [out, r*E] (a second
parameter's wrapper nests one `.base_layer` deeper); expert `e`'s pair is A's rows `e*r:(e+1)*r`
and B's columns `e, E + e, 2E + e, ...`, and PEFT serves `W_e + scale * B_e @ A_e`. Which parameter
a pair belongs to follows from its shapes (gate_up reads H and writes 2I, down reads I and writes
H), so the nesting order does not matter. Our experts use the same stacked layout (workers/model/
moe.py), so the pairs apply as they are. A step holding adapter rows on a layer whose experts an
adapter targets recomputes those rows' experts in torch with each expert's delta added inside
(before the activation for gate_up), replacing what the layer's kernel gave for them; base rows and
other adapters' rows keep the kernel's output. Trade-off: those rows pay their experts twice (the
kernel's pass and this one) and a Python loop over their active experts; in exchange every expert
kernel serves base rows unchanged. Expert weights that are not floats (fp8, packed GGUF or MXFP4
blocks) and gpt-oss's transposed, interleaved experts are refused at load with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.moe import FusedMoE, expert_activation

PARAMETERS = ("gate_up_proj", "down_proj")  # the `target_parameters` of Hugging Face's fused experts
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, eq=False)
class ExpertLora:
    """One adapter's pairs on one layer's experts: A [E, r, in], B [E, out, r] per parameter (None: untouched)."""

    gate_up: tuple[torch.Tensor, torch.Tensor] | None = None
    down: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for pair in (self.gate_up, self.down) if pair is not None for t in pair)

    def to(self, device) -> ExpertLora:
        pairs = (self.gate_up, self.down)
        return ExpertLora(*(None if p is None else (p[0].to(device), p[1].to(device)) for p in pairs))


def check_target_parameters(path, values) -> None:
    """`adapter_config.json`'s `target_parameters`: only the experts' two stacked parameters."""
    from workers.lora.adapter import LoraError

    bad = [v for v in values or () if v.rsplit(".", 1)[-1] not in PARAMETERS or ".experts" not in f".{v}"]
    if bad:
        raise LoraError(f"LoRA adapter `{path}` targets the parameter `{bad[0]}`, which this server does not apply. "
                        f"Accepted `target_parameters`: the experts' {' and '.join(PARAMETERS)}")


def is_expert_module(module_name: str) -> bool:
    """Whether PEFT's module name is a wrapper of the fused experts' parameters."""
    stem = module_name
    while stem.endswith(".base_layer"):
        stem = stem.removesuffix(".base_layer")
    return stem.endswith(".experts")


def read_experts(name: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], model: nn.Module, architecture: str,
                 dtype: torch.dtype, device) -> dict[str, ExpertLora]:
    """The expert pairs of `pairs` (PEFT module -> (A, B); taken out of it) as our FusedMoE module name
    -> `ExpertLora`, in `dtype` on `device`; a pair that does not fit is a `LoraError` naming it."""
    from workers.lora.adapter import LoraError

    layers = {m.group(1): (n, mod) for n, mod in model.named_modules()
              if isinstance(mod, FusedMoE) and (m := _LAYER.search(f".{n}")) is not None}
    found: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module_name in [m for m in pairs if is_expert_module(m)]:
        a, b = pairs.pop(module_name)
        layer = _LAYER.search(f".{module_name}")
        ours, experts = layers.get(layer.group(1) if layer else "", (None, None))
        if experts is None:
            raise LoraError(f"LoRA adapter `{name}` targets `{module_name}`, which has no experts in this "
                            f"`{architecture}` model")
        if architecture == "gpt_oss" or not experts.w_gate_up.dtype.is_floating_point \
                or experts.w_gate_up.element_size() == 1:
            why = "its experts are stored transposed and interleaved" if architecture == "gpt_oss" else \
                f"its experts are `{experts.w_gate_up.dtype}` blocks, not floats"
            raise LoraError(f"LoRA adapter `{name}` targets the experts of `{module_name}`; this worker cannot add "
                            f"adapters to them ({why}). Accepted: attention and dense MLP projections there")
        e, (two_i, h), i = experts.num_experts, experts.w_gate_up.shape[1:], experts.w_down.shape[2]
        kind = {(h, two_i): "gate_up", (i, h): "down"}.get((a.shape[1], b.shape[0]))
        if kind is None or a.shape[0] % e or b.shape[1] != a.shape[0]:
            raise LoraError(f"LoRA adapter `{name}`: `{module_name}` has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                            f"these experts take A (r*{e}, {h}) and B ({two_i}, r*{e}) (gate_up) or A (r*{e}, {i}) "
                            f"and B ({h}, r*{e}) (down): an adapter of another base")
        r = a.shape[0] // e
        a_e = a.reshape(e, r, a.shape[1])  # [E, r, in]
        b_e = b.reshape(b.shape[0], r, e).permute(2, 0, 1)  # [E, out, r]
        found.setdefault(ours, {})[kind] = (a_e.to(device, dtype).contiguous(), b_e.to(device, dtype).contiguous())
    return {ours: ExpertLora(p.get("gate_up"), p.get("down")) for ours, p in found.items()}


def _delta(x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor] | None, e: int,
           scale: float) -> torch.Tensor | None:
    if pair is None:
        return None
    a, b = pair
    return ((x.to(a.dtype) @ a[e].T) @ b[e].T) * scale  # [n, in] -> [n, r] -> [n, out]


def experts_with_lora(experts: FusedMoE, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, lora: ExpertLora,
                      scale: float) -> torch.Tensor:
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) with `lora`'s delta inside each expert: x [n, H],
    ids / weights [n, K] -> [n, H] in x's dtype (workers/model/moe.py `grouped_experts` plus the pairs)."""
    out = torch.zeros_like(x)
    b_gu, b_d = experts.b_gate_up, experts.b_down
    for e in ids.unique().tolist():
        token, k = (ids == e).nonzero(as_tuple=True)
        xs = x.index_select(0, token)  # [m, H]
        h = F.linear(xs, experts.w_gate_up[e], None if b_gu is None else b_gu[e])  # [m, 2I]
        delta = _delta(xs, lora.gate_up, e, scale)
        if delta is not None:
            h = h + delta.to(h.dtype)
        act = expert_activation(h, experts.activation, experts.alpha, experts.limit)  # [m, I]
        y = F.linear(act, experts.w_down[e], None if b_d is None else b_d[e])  # [m, H]
        delta = _delta(act, lora.down, e, scale)
        if delta is not None:
            y = y + delta.to(y.dtype)
        out.index_add_(0, token, y * weights[token, k, None].to(y.dtype))
    return out


def hook_experts(model: nn.Module, state) -> int:
    """A forward hook on every FusedMoE of `model` reading `state.batch` (workers/lora/apply.py); the count."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            module.register_forward_hook(_hook(name, state))
            count += 1
    return count


def _hook(name: str, state):
    def hook(module: FusedMoE, args: tuple, out: torch.Tensor) -> None:
        batch = state.batch
        if batch is None:
            return
        x, ids, weights = args
        for adapter, rows in batch.groups:
            lora = adapter.experts.get(name)
            if lora is not None:  # these rows' experts again, each with its delta inside
                got = experts_with_lora(module, x.index_select(0, rows), ids.index_select(0, rows),
                                        weights.index_select(0, rows), lora, adapter.scale)
                out.index_copy_(0, rows, got.to(out.dtype))

    return hook
