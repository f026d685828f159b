"""The `quant_method: fp8` format (Qwen3-*-FP8, DeepSeek-V3, transformers' FineGrainedFP8).

Design: `read(qc)` turns the config into a `QuantConfig` whose one group targets every linear
layer: 128 x 128 blocks with `weight_scale_inv` (despite its name, the multiplier that
dequantizes: w = q * s per block) and activations per token and group of 128 columns, or, without
`weight_block_size`, the older per-tensor form. `modules_to_not_convert` (transformers) and
`ignored_layers` (vLLM) match module names or path components. The tensors and refusals:
docs/quantized-checkpoints.md. Trade-off: the format carries no per-layer targets, so a checkpoint
whose tensors disagree with the config fails at load naming the tensor, never silently."""

from __future__ import annotations

from workers.quant.scheme import SUPPORTED_BLOCK, Fp8Scheme, QuantConfig, unsupported

NAME = "fp8"
ACTIVATION_SCHEMES = ("dynamic", "static")


def read(qc: dict) -> QuantConfig:
    """The `QuantConfig` of a `quant_method: fp8` config; `UnsupportedQuantizationError` otherwise
    (an `fmt` other than e4m3, blocks other than 128 x 128, static activations with blocks)."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise unsupported("fp8 `fmt`", fmt, ["e4m3"])
    act = qc.get("activation_scheme", "dynamic")
    if act not in ACTIVATION_SCHEMES:
        raise unsupported("fp8 `activation_scheme`", act, ACTIVATION_SCHEMES)
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is not None:
        if tuple(block) != SUPPORTED_BLOCK:
            raise unsupported("fp8 `weight_block_size`", block, [list(SUPPORTED_BLOCK)])
        if act != "dynamic":
            raise unsupported("fp8 `activation_scheme` with `weight_block_size`", act, ["dynamic"])
        scheme = Fp8Scheme("block", "dynamic_group", SUPPORTED_BLOCK, scale_name="weight_scale_inv")
        return QuantConfig(NAME, "block-wise", ((("Linear",), scheme),), ignore, ignore_rule="module")
    scheme = Fp8Scheme("tensor", "dynamic_token" if act == "dynamic" else "static_tensor")
    notes = ("dynamic activations run per token",) if act == "dynamic" else ()
    return QuantConfig(NAME, "per-tensor", ((("Linear",), scheme),), ignore, ignore_rule="module", notes=notes)
