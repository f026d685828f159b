"""What a checkpoint's architecture asks of a device, as plain JSON: for `/capability` and `plan`.

Design: one function reads the `ModelConfig` (no weights) and says what the architecture
switches on (`features`) and how its layers attend per layer type (full or sliding and over how
many positions, the options every attention shares, which kernel-swappable layers the model
contains); linear-attention layers, which hold no KV, are described apart (`attention.linear`),
and a pre-quantized checkpoint adds its `quantization` and a `features` entry naming its method.
The router holds no torch, so `hetserve plan --model DIR` runs `python -m workers.model.describe
DIR` and joins the answer with each device's kernel choices; a ready worker reports the same under
`model`. Trade-off: a child process per plan, for one source of the rules."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from workers.kv.groups import layer_groups
from workers.model.config import ConfigError, ModelConfig
from workers.quant.registry import describe_quantization
from workers.quant.scheme import UnsupportedQuantizationError


def attention_layers(config: ModelConfig) -> list[dict[str, Any]]:
    """Per layer type (full first, then each window; each cache shape): its layers, what they
    attend, their head dim and KV heads, and the layers among them that read an earlier layer's
    KV instead of computing their own (`kv_shared_layers`: the cache holds it once)."""
    out = []
    for window, layers in layer_groups(config.layer_windows, config.layer_kv_shapes):
        readers = [i for i in range(config.num_hidden_layers) if config.kv_source(i) in layers]
        first = layers[0]
        entry: dict[str, Any] = {"type": "full" if window is None else "sliding", "layers": sorted((*layers, *readers)),
                                 "head_dim": config.layer_head_dim(first), "kv_heads": config.layer_kv_heads(first)}
        if window is not None:
            entry["window"] = window
        if readers:
            entry["kv_shared_layers"] = {str(i): config.kv_source(i) for i in readers}  # reader -> the layer it reads
        if config.layer_k_eq_v(first):
            entry["k_eq_v"] = True
        nope = sorted(set(layers) & set(config.nope_layers))
        if nope:
            entry["nope_layers"] = nope
        out.append(entry)
    return out


def linear_layers(config: ModelConfig) -> dict[str, Any] | None:
    """The Gated DeltaNet layers: which, their heads, and the state each sequence keeps in each
    (workers/kv/state.py); None for a model without them."""
    if not config.state_layers:
        return None
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    return {"type": "linear", "kind": "gated_deltanet", "layers": list(config.state_layers),
            "key_heads": config.linear_num_key_heads, "value_heads": hv, "key_head_dim": dk, "value_head_dim": dv,
            "conv_kernel": config.linear_conv_kernel,
            "state": f"per sequence and layer: conv [{config.linear_conv_dim}, {config.linear_conv_kernel - 1}] in "
                     f"the model dtype, recurrent [{hv}, {dk}, {dv}] fp32; a prefix reused where a snapshot of it "
                     "at a block boundary is (workers/kv/snapshots.py)",
            "recurrent_state_bytes": len(config.state_layers) * hv * dk * dv * 4}


_NORMS = {"fp32": "its RMSNorm weighs in fp32 (the family's own, torch)",
          "gemma": "its RMSNorm scales by (1 + w) in fp32 (the family's own, torch)",
          "gemma4": "its RMSNorm is Gemma 4's, pow(mean + eps, -0.5) and w in fp32 (the family's own, torch)"}


def describe(config: ModelConfig) -> dict[str, Any]:
    """`architecture`, `features`, `attention` {head_dim, scale, softcap, layer_types} and the
    kernel-swappable layers the model lacks, each with why (`kernel_layers_unused`)."""
    unused = {}
    if config.norm_style != "llama":
        unused["RMSNorm"] = _NORMS[config.norm_style]
    if config.activation != "silu" or (config.num_experts and len(config.sparse_layers) == config.num_hidden_layers):
        unused["SiluAndMul"] = (f"its activation is {config.activation} (torch)" if config.activation != "silu"
                                else "every feed-forward is a mixture of experts (FusedMoE)")
    if not config.num_experts:
        unused["FusedMoE"] = "a dense model: no experts"
    if not config.state_layers:
        unused["GatedDeltaRule"] = "no linear-attention layers"
    attention = {
        "head_dim": config.head_dim,
        "scale": config.attention_scale,  # None: 1/sqrt(head_dim)
        "softcap": config.attn_softcap,
        "sinks": config.attention_sinks,
        "layer_types": attention_layers(config),
    }
    linear = linear_layers(config)
    if linear is not None:
        attention["linear"] = linear
    return {
        "architecture": config.architecture,
        "features": config.features,
        "attention": attention,
        "kernel_layers_unused": unused,
    }


def describe_dir(model_dir: str | Path) -> dict[str, Any]:
    """`describe` of a model directory's config.json; `ConfigError` naming what is wrong."""
    path = Path(model_dir) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"`{path}` cannot be read: {e.strerror}; "
                          f"`--model` takes a directory with a config.json") from e
    except ValueError as e:
        raise ConfigError(f"`{path}` is not valid JSON: {e}") from e
    out = describe(ModelConfig.from_hf_config(hf))
    quantization = describe_quantization(hf)  # a pre-quantized checkpoint: what it stores (the registry's reading)
    if quantization is not None:  # `plan --model` prints the features: the method, and its execution where one
        out["quantization"] = quantization  # rule holds for every device (MXFP4: dequantized at load)
        how = f" {quantization['execution']} ({quantization['reason']})" if quantization.get("execution") else ""
        out["features"]["quantization"] = f"{quantization['method']} {quantization['format']}{how}"
    if (Path(model_dir) / "gguf.json").is_file():  # a prepared GGUF directory: its blocks run per device's GGUF rule
        out["gguf"] = True
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m workers.model.describe MODEL_DIR", file=sys.stderr)
        return 2
    try:
        print(json.dumps(describe_dir(args[0])))
    except (ConfigError, UnsupportedQuantizationError) as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
