"""The quantization-method registry: configs read into schemes per layer, `ignore` lists honoured, and
every method, format or scheme no layer runs refused by name with what is supported.

The compressed-tensors configs are the ones the library itself writes (its presets through
`QuantizationConfig`, dumped as `update_config` writes them into config.json); the block-wise fp8
configs are the format's own keys (Qwen3-FP8, DeepSeek-V3)."""

from __future__ import annotations

import pytest

from workers.quant.registry import METHODS, describe_quantization, read_quantization
from workers.quant.scheme import Fp8Scheme, UnsupportedQuantizationError


def ct_config(preset: str, ignore=("lm_head",), **overrides) -> dict:
    """A compressed-tensors `quantization_config` as the library writes it for `preset`."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore), quantization_status="compressed",
                            format="float-quantized")
    dumped = qc.model_dump(mode="json")
    dumped["config_groups"]["group_0"]["format"] = "float-quantized"
    return {"quantization_config": {**dumped, "quant_method": "compressed-tensors", **overrides}}


def block_config(**overrides) -> dict:
    return {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "mlp.gate"],
                                    **overrides}}


@pytest.mark.parametrize("preset,scheme", [
    ("FP8_DYNAMIC", Fp8Scheme("channel", "dynamic_token")),
    ("FP8", Fp8Scheme("tensor", "static_tensor")),
    ("FP8_BLOCK", Fp8Scheme("block", "dynamic_group", (128, 128))),
])
def test_each_compressed_tensors_preset_maps_linear_layers_to_its_scheme(preset, scheme):
    quant = read_quantization(ct_config(preset, ignore=("lm_head", "re:.*mlp\\.down_proj$")))
    assert quant.method == "compressed-tensors" and quant.format == "float-quantized"
    assert quant.scheme_for("model.layers.0.self_attn.q_proj") == scheme
    assert quant.scheme_for("model.layers.3.mlp.up_proj") == scheme
    # the ignore list: an exact name and a `re:` pattern (matched from the start, as the library does)
    assert quant.scheme_for("lm_head") is None and quant.scheme_for("model.layers.1.mlp.down_proj") is None
    assert scheme.tensors == (("weight_scale", "input_scale") if preset == "FP8" else ("weight_scale",))


def test_targets_name_classes_modules_and_patterns_and_the_first_group_wins():
    qc = ct_config("FP8_DYNAMIC")
    groups = qc["quantization_config"]["config_groups"]
    static = ct_config("FP8")["quantization_config"]["config_groups"]["group_0"]
    qc["quantization_config"]["config_groups"] = {"attn": {**static, "targets": ["re:.*self_attn\\..*_proj$"]},
                                                  "rest": {**groups["group_0"], "targets": ["Linear"]}}
    quant = read_quantization(qc)
    assert quant.scheme_for("model.layers.0.self_attn.o_proj").activations == "static_tensor"
    assert quant.scheme_for("model.layers.0.mlp.gate_proj").activations == "dynamic_token"
    # a class target matches only that class: an embedding is not a `Linear`
    assert quant.scheme_for("model.embed_tokens", module_class="Embedding") is None


def test_dynamic_per_tensor_activations_run_per_token_and_say_so():
    qc = ct_config("FP8_DYNAMIC")
    qc["quantization_config"]["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor"
    quant = read_quantization(qc)
    assert quant.scheme_for("model.layers.0.mlp.up_proj").activations == "dynamic_token"
    assert any("run per token" in n for n in quant.notes)


@pytest.mark.parametrize("change,match", [
    (lambda q: q.update(quant_method="hqq"),
     "quantization method `hqq`. Supported: awq; compressed-tensors; fp8; gptq"),
    (lambda q: q["config_groups"]["group_0"].update(format="pack-quantized"),
     "format of config group `group_0` `pack-quantized`. Supported: float-quantized; naive-quantized"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4),
     "weight type of config group `group_0` `int4`. Supported: float8"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations=None),
     "input activations of config group `group_0` `None`"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), "`kv_cache_scheme`"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric=False), "`asymmetric`"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
     "activation scheme of config group `group_0` `static token"),
    (lambda q: q["config_groups"]["group_0"].update(output_activations={"num_bits": 8}),
     "output activation quantization"),
])
def test_what_no_layer_runs_is_a_named_error_listing_what_is_supported(change, match):
    qc = ct_config("FP8_DYNAMIC")
    change(qc["quantization_config"])
    with pytest.raises(UnsupportedQuantizationError, match=match.replace("(", r"\(").replace(")", r"\)")):
        read_quantization(qc)


def test_the_registry_holds_one_module_per_method_and_no_config_is_unquantized():
    assert sorted(METHODS) == ["compressed-tensors", "fp8", "mxfp4"]
    assert read_quantization({"architectures": ["LlamaForCausalLM"]}) is None
    assert describe_quantization({}) is None


def test_the_block_wise_format_and_its_module_ignore_list():
    quant = read_quantization(block_config())
    scheme = quant.scheme_for("model.layers.0.mlp.experts.3.down_proj")
    assert scheme == Fp8Scheme("block", "dynamic_group", (128, 128), scale_name="weight_scale_inv")
    assert scheme.tensors == ("weight_scale_inv",) and scheme.act_group == 128
    # `mlp.gate` names the router, a path component: not the experts' gate_proj next to it
    assert quant.scheme_for("model.layers.0.mlp.gate") is None and quant.scheme_for("lm_head") is None
    assert quant.scheme_for("model.layers.0.mlp.gate_proj") is not None
    described = describe_quantization(block_config())
    assert described["format"] == "block-wise" and described["schemes"][0]["block"] == [128, 128]


def test_the_per_tensor_fp8_format():
    static = read_quantization(block_config(weight_block_size=None, activation_scheme="static"))
    assert static.scheme_for("model.layers.0.self_attn.o_proj") == Fp8Scheme("tensor", "static_tensor")
    dynamic = read_quantization(block_config(weight_block_size=None, ignored_layers=["model.layers.0.mlp.up_proj"]))
    assert dynamic.scheme_for("model.layers.1.mlp.up_proj").activations == "dynamic_token"
    assert dynamic.scheme_for("model.layers.0.mlp.up_proj") is None


@pytest.mark.parametrize("overrides,match", [
    ({"fmt": "e5m2"}, "fp8 `fmt` `e5m2`. Supported: e4m3"),
    ({"weight_block_size": [64, 64]}, r"`weight_block_size` `\[64, 64\]`. Supported: \[128, 128\]"),
    ({"activation_scheme": "static"}, "`activation_scheme` with `weight_block_size` `static`. Supported: dynamic"),
    ({"activation_scheme": "per-row"}, "`activation_scheme` `per-row`. Supported: dynamic; static"),
])
def test_block_wise_values_no_layer_runs_are_named(overrides, match):
    with pytest.raises(UnsupportedQuantizationError, match=match):
        read_quantization(block_config(**overrides))


def test_a_scheme_outside_the_supported_pairs_is_refused():
    with pytest.raises(UnsupportedQuantizationError, match="`channel/dynamic_group`"):
        Fp8Scheme("channel", "dynamic_group")
    with pytest.raises(UnsupportedQuantizationError, match="fp8 weight strategy `group`"):
        Fp8Scheme("group", "dynamic_token")
