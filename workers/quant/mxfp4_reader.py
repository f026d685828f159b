"""Reading an MXFP4 checkpoint (gpt-oss's experts in e2m1 with e8m0 scales) for this device's execution.

Design: driven by the loader through the same calls as the fp8 and 4-bit readers
(workers/quant/checkpoint.py); `claims` takes every `P_blocks` / `P_scales` of an experts
projection the config quantizes and `covers` says `P` is made from them. The execution comes
from the MXFP4 rule for the device the loader names. `to_ours` checks each projection
(`check_stored`); `w4a16` keeps the bytes in our row order (gpt-oss interleaves gate and up rows)
and `install` swaps in `Mxfp4FusedMoE`, while `dequantized` widens them into the orientation gpt-oss
stores unquantized and hands them to the family's own map. The refusals: docs/quantization-mxfp4.md.
Trade-off: a dequantizing device holds the experts at their widened size."""

from __future__ import annotations

import logging

import torch
from torch import nn

from workers.contract.mxfp4_rule import MXFP4_W4A16
from workers.quant.checkpoint import ModelMap
from workers.quant.mxfp4 import (
    LEAVES,
    Mxfp4Config,
    Mxfp4TensorError,
    check_stored,
    dequantize,
    mxfp4_execution,
)
from workers.quant.mxfp4_experts import Mxfp4FusedMoE
from workers.quant.scheme import UnsupportedQuantizationError

logger = logging.getLogger(__name__)

EXPERT_TENSORS = ("experts.w_gate_up", "experts.w_down")  # ours: where an MXFP4 projection may land


class Mxfp4Checkpoint:
    def __init__(self, quant: Mxfp4Config, model_map: ModelMap, device_type: str,
                 capability: tuple[int, int] | None) -> None:  # fmt: skip
        self.quant, self.map = quant, model_map
        self.device_type, self.capability = device_type, capability
        self.execution = mxfp4_execution(self.device_type, self.capability)
        self.packed: dict[str, tuple[int, int, int]] = {}  # our experts module kept packed -> (E, H, I)
        self.expected: dict[str, tuple[int, ...]] = {}
        self.dtype = torch.float32
        # the HF projections stored in MXFP4 (`model.layers.0.mlp.experts.down_proj`)
        self.projections: set[str] = set()
        self.stored_bytes = self.weight_bytes = 0
        self.notes: list[str] = list(quant.notes)

    def bind(self, model: nn.Module, expected: dict[str, tuple[int, ...]]) -> None:
        """Note the HF tensors `expected` (name -> shape) of `model` and the model dtype."""
        self.expected, self.dtype = dict(expected), model.dtype

    def claims(self, name: str) -> bool:
        """Whether tensor `name` is an MXFP4 projection's blocks or scales (handed to `to_ours` as stored)."""
        leaf = next((s for s in LEAVES if name.endswith(s)), None)
        if leaf is None:
            return False
        projection = name.removesuffix(leaf)
        module = projection.rpartition(".")[0]
        mapped = self.map.map_name(projection) if projection in self.expected else None
        if mapped is None or not mapped[0].endswith(EXPERT_TENSORS):
            raise UnsupportedQuantizationError(
                f"Unsupported MXFP4 tensor `{name}`: `{projection}` is not a stacked experts projection of this "
                f"`{self.map.architecture}` checkpoint. Supported: MXFP4 on gpt-oss's "
                "`mlp.experts.gate_up_proj` and `mlp.experts.down_proj`"
            )
        if self.quant.ignored(module):
            raise UnsupportedQuantizationError(
                f"Unsupported MXFP4 tensor `{name}`: the config leaves `{module}` unquantized (modules_to_not_convert: "
                f"{', '.join(f'`{p}`' for p in self.quant.ignore) or 'none'}). Supported: MXFP4 tensors only on the "
                "experts the config quantizes"
            )
        self.projections.add(projection)
        return True

    def covers(self, hf_name: str) -> bool:
        """Whether an expected HF tensor (an experts projection) is made by `to_ours` from its blocks and scales."""
        return hf_name in self.projections

    # -- stored tensors -> ours ------------------------------------------------------------------

    def _stored(self, projection: str, stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One projection's blocks [E, N, K/32, 16] and scales [E, N, K/32], checked."""
        blocks, scales = (stored.get(projection + leaf) for leaf in LEAVES)
        if blocks is None or scales is None:
            missing = projection + (LEAVES[0] if blocks is None else LEAVES[1])
            raise Mxfp4TensorError(f"`{projection}` is stored in MXFP4 but the checkpoint has no `{missing}`")
        e, k, n = self.expected[projection]  # the unquantized tensor's shape: [E, K inputs, N outputs]
        check_stored(projection, blocks, scales, (e, n, k))
        return blocks, scales

    def _packed(self, projection: str, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One projection kept packed, in our row order: `<ours>_blocks` [E, N, K/2], `<ours>_scales` [E, N, K/32]."""
        blocks, scales = self._stored(projection, stored)
        ours = self.map.map_name(projection)[0]  # `layers.0.feed_forward.experts.w_gate_up`
        e, n = blocks.shape[:2]
        if ours.endswith(".w_gate_up"):  # gpt-oss's rows alternate gate, up: ours are gate rows, then up rows
            blocks = torch.cat((blocks[:, 0::2], blocks[:, 1::2]), dim=1)
            scales = torch.cat((scales[:, 0::2], scales[:, 1::2]), dim=1)
            module = ours.removesuffix(".w_gate_up")
            self.packed[module] = (e, blocks.shape[2] * 32, n // 2)
        return {
            f"{ours}_blocks": blocks.reshape(e, n, -1).contiguous(),
            f"{ours}_scales": scales.contiguous(),
        }

    def _dequantize(self, projection: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """One projection in the model dtype and gpt-oss's unquantized orientation [E, K, N]."""
        blocks, scales = self._stored(projection, stored)
        w = dequantize(blocks, scales, self.dtype)  # [E, N, K]
        if self.dtype == torch.float16 and bool(torch.isinf(w).any()):
            raise Mxfp4TensorError(
                f"`{projection}` dequantizes beyond float16's range (its scales reach "
                f"2^{int(scales.max()) - 127}); serve it with `--dtype bfloat16` or `float32`"
            )
        return w.transpose(1, 2)

    def to_ours(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state-dict entries of the MXFP4 experts: kept packed in our row order (`w4a16`), or
        dequantized and placed by the family's map."""
        self.stored_bytes = sum(t.numel() * t.element_size() for t in stored.values())
        if self.execution.kind == MXFP4_W4A16:
            out: dict[str, torch.Tensor] = {}
            for p in sorted(self.projections):
                out |= self._packed(p, stored)
            self.weight_bytes = sum(t.numel() * t.element_size() for t in out.values())
            return out
        hf = {p: self._dequantize(p, stored) for p in sorted(self.projections)}
        self.weight_bytes = sum(t.numel() * t.element_size() for t in hf.values())
        return self.map.to_ours(hf)

    def install(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> int:
        """Swap the `FusedMoE` of each layer whose experts stay packed for an `Mxfp4FusedMoE`; how many."""
        for module, (e, h, i) in self.packed.items():
            parent_name, _, attr = module.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, attr)
            if type(old) is not self.map.experts:
                raise UnsupportedQuantizationError(f"Unsupported MXFP4 experts `{module}`: the layer is "
                                                   f"`{type(old).__name__}`. Supported: a "
                                                   f"`{self.map.experts.__name__}`")  # fmt: skip
            layer = Mxfp4FusedMoE(e, h, i, old.b_gate_up is not None, old.activation, old.alpha, old.limit,
                                  dtype=self.dtype, device="meta")  # fmt: skip
            setattr(parent, attr, layer)
        how = "kept packed" if self.execution.kind == MXFP4_W4A16 else "dequantized at load"
        log = logger.info if self.execution.kind == MXFP4_W4A16 else logger.warning
        log("mxfp4 checkpoint %s: %d expert projections, %d bytes stored -> %d bytes held (%s)", how,
            len(self.projections), self.stored_bytes, self.weight_bytes, self.execution.reason)  # fmt: skip
        return len(self.packed)

    def describe(self, device_type: str | None = None, capability: tuple[int, int] | None = None) -> dict:
        """The checkpoint's quantization, its execution (this reader's device unless another is named) and bytes."""
        execution = self.execution if device_type is None else mxfp4_execution(device_type, capability)
        return {
            **self.quant.describe(),
            "notes": list(self.notes),
            "quantized_modules": len(self.projections),
            "execution": execution.kind,
            "reason": execution.reason,
            "dtype": str(self.dtype).removeprefix("torch."),
            "stored_bytes": self.stored_bytes,
            "weight_bytes": self.weight_bytes,
            "widened_bytes": max(0, self.weight_bytes - self.stored_bytes),
        }
