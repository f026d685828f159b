"""The `quant_method: fp8` format (Qwen3-*-FP8, DeepSeek-V3, transformers' FineGrainedFP8).

Design: `read(qc)` turns `{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}` into a `QuantConfig` whose one group targets every linear layer:
weights stored as `weight` (float8_e4m3fn) with `weight_scale_inv` [ceil(out/128), ceil(in/128)]
(despite its name, the multiplier that dequantizes: w = q * s per block), activations quantized at
run time per token and group of 128 columns (the block's width). Without `weight_block_size` it is
the older per-tensor fp8 format: `weight_scale` per tensor, activations dynamic (run per token) or
static (`input_scale`). Modules left unquantized are named in `modules_to_not_convert`
(transformers) or `ignored_layers` (vLLM), matched as module names or path components (`lm_head`,
`mlp.gate`). Refused by name: an `fmt` other than e4m3, blocks other than 128 x 128, static
activations with blocks. The trade-off: the format carries no per-layer targets, so a checkpoint
whose tensors disagree with the config fails at load naming the tensor, never silently.
"""

from __future__ import annotations

from workers.quant.scheme import SUPPORTED_BLOCK, Fp8Scheme, QuantConfig, unsupported

NAME = "fp8"
ACTIVATION_SCHEMES = ("dynamic", "static")


def read(qc: dict) -> QuantConfig:
    """The `QuantConfig` of a `quant_method: fp8` config; `UnsupportedQuantizationError` otherwise."""
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
