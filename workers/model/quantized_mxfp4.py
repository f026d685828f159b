"""Reading an MXFP4 checkpoint (gpt-oss's experts in e2m1 with e8m0 scales): dequantized at load.

Design: the loader drives this reader through the same five calls as the fp8 and 4-bit ones
(workers/model/quantized.py, quantized_int4.py): `bind` notes the HF tensors the model expects,
`claims` takes every `P_blocks` / `P_scales` of an experts projection `P` the config quantizes,
`covers` tells the loader that `P` itself (the unquantized tensor the family's map expects) is made
from them, `to_ours` checks each projection's dtype and shapes (workers/quant/mxfp4.py
`check_stored`), dequantizes it into the model dtype, turns it into the orientation gpt-oss stores
unquantized ([E, K, N]: gate and up interleaved along N) and hands it to the family's own weight
map, so it lands in `FusedMoE.w_gate_up` / `w_down` exactly as an unquantized checkpoint's would;
`install` then has nothing to swap. Refused by name: MXFP4 tensors on a module the config leaves
alone (`modules_to_not_convert`), on anything but a stacked experts projection (only gpt-oss stores
them so), a projection with its blocks but not its scales (or the reverse), and a float16 model whose
experts overflow it. `describe` gives `/workers` the method, scheme, the device rule's execution and
reason (`mxfp4_execution`) and the bytes as stored and as widened. The trade-off: the experts take
their dequantized twin's memory until an MXFP4 kernel runs them packed.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from workers.model.config import ModelConfig
from workers.model.weights import map_name, to_ours
from workers.quant.mxfp4 import (
    LEAVES,
    Mxfp4Config,
    Mxfp4TensorError,
    check_stored,
    dequantize,
    mxfp4_execution,
)
from workers.quant.scheme import UnsupportedQuantizationError

logger = logging.getLogger(__name__)

EXPERT_TENSORS = ("experts.w_gate_up", "experts.w_down")  # ours: where an MXFP4 projection may land


class Mxfp4Checkpoint:
    def __init__(self, quant: Mxfp4Config, config: ModelConfig) -> None:
        self.quant, self.config = quant, config
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
        mapped = map_name(projection, self.config) if projection in self.expected else None
        if mapped is None or not mapped[0].endswith(EXPERT_TENSORS):
            raise UnsupportedQuantizationError(
                f"Unsupported MXFP4 tensor `{name}`: `{projection}` is not a stacked experts projection of this "
                f"`{self.config.architecture}` checkpoint. Supported: MXFP4 on gpt-oss's "
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

    def _dequantize(self, projection: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """One projection in the model dtype and gpt-oss's unquantized orientation [E, K, N]."""
        blocks, scales = (stored.get(projection + leaf) for leaf in LEAVES)
        if blocks is None or scales is None:
            missing = projection + (LEAVES[0] if blocks is None else LEAVES[1])
            raise Mxfp4TensorError(f"`{projection}` is stored in MXFP4 but the checkpoint has no `{missing}`")
        e, k, n = self.expected[projection]  # the unquantized tensor's shape: [E, K inputs, N outputs]
        check_stored(projection, blocks, scales, (e, n, k))
        w = dequantize(blocks, scales, self.dtype)  # [E, N, K]
        if self.dtype == torch.float16 and bool(torch.isinf(w).any()):
            raise Mxfp4TensorError(
                f"`{projection}` dequantizes beyond float16's range (its scales reach "
                f"2^{int(scales.max()) - 127}); serve it with `--dtype bfloat16` or `float32`"
            )
        return w.transpose(1, 2)

    def to_ours(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state-dict entries of the MXFP4 experts: dequantized, placed by the family's map."""
        hf = {p: self._dequantize(p, stored) for p in sorted(self.projections)}
        self.stored_bytes = sum(t.numel() * t.element_size() for t in stored.values())
        self.weight_bytes = sum(t.numel() * t.element_size() for t in hf.values())
        return to_ours(hf, self.config)

    def install(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> int:
        """Nothing to swap: the experts are the fused MoE layer's own weights, dequantized."""
        logger.warning(
            "mxfp4 checkpoint dequantized at load: %d expert projections, %d bytes stored -> %d bytes in %s "
            "(%s)",
            len(self.projections),
            self.stored_bytes,
            self.weight_bytes,
            self.dtype,
            mxfp4_execution(None).reason,
        )
        return 0

    def describe(self, device_type: str | None = None, capability: tuple[int, int] | None = None) -> dict:
        """The checkpoint's quantization, its execution (for `device_type`, default every device) and bytes."""
        execution = mxfp4_execution(device_type, capability)
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
