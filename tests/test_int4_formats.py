"""4-bit formats: configs read into schemes, tensors unpacked and dequantized as each reference does.

What must hold:
- the unpacked integers are the packed ones, in either dim and in AWQ's interleaved order, words with
  the sign bit set included;
- GPTQ (every group size, symmetric and not, v1 and v2 zero points, act-order), AWQ (GEMM layout)
  and pack-quantized (groups and per channel, with and without zero points) dequantize to the
  reference `(q - z) * s` in the scales' dtype bit for bit, the checkpoints packed in the test from
  the format's definition (tests/int4_checkpoints.py);
- pack-quantized is cross-checked with compressed-tensors itself: its compressor packs the same
  bytes as the definition, its decompressor gives our weights bit for bit;
- `modules_to_not_convert` and `ignore` leave their modules unquantized; every unsupported bit
  width, group size, format or strategy is a named error listing what is accepted;
- the device rule gives every device its execution with the reason.
"""

from __future__ import annotations

import pytest
import torch

from tests.int4_checkpoints import AWQ_ORDER, _words, awq_tensors, gptq_tensors, pack_quantized_tensors
from workers.quant.int4_methods import int4_execution
from workers.quant.int4_pack import (
    Int4TensorError,
    dequantize_awq,
    dequantize_gptq,
    dequantize_pack_quantized,
    pack_int32,
    unpack_int32,
)
from workers.quant.registry import read_quantization
from workers.quant.scheme import UnsupportedQuantizationError

OUT, IN = 40, 96  # odd enough: 5 words of outputs, groups of 64 that do not divide the inputs


def _weight(seed: int = 0, out: int = OUT, k: int = IN) -> torch.Tensor:
    return torch.randn(out, k, generator=torch.Generator().manual_seed(seed)) * 0.1


def test_unpacking_gives_back_every_nibble_in_either_dim_and_the_awq_order():
    values = torch.randint(0, 16, (24, 40), generator=torch.Generator().manual_seed(1))
    values[0, :8] = 15  # a word with its sign bit set
    for order, awq in ((tuple(range(8)), False), (AWQ_ORDER, True)):
        words = _words(values, order)  # [24, 5]
        assert words.dtype == torch.int32 and bool((words < 0).any())
        assert torch.equal(unpack_int32(words, 40, dim=1, awq_order=awq), values)
        assert torch.equal(unpack_int32(words.t(), 40, dim=0, awq_order=awq), values.t())
        assert torch.equal(pack_int32(values, dim=1, awq_order=awq), words)
    # AWQ's order is not the plain one: the same words read plainly give other columns
    assert not torch.equal(unpack_int32(_words(values, AWQ_ORDER), 40), values)
    assert torch.equal(unpack_int32(pack_int32(values[:, :37]), 37), values[:, :37])  # a partial last word
    with pytest.raises(Int4TensorError, match="torch.int64"):
        unpack_int32(values, 40)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_gptq_dequantizes_to_the_reference_bit_for_bit(group, sym, fmt, desc_act, dtype):
    t, ref = gptq_tensors(_weight(), group, sym, fmt, desc_act, dtype)
    assert t["qweight"].shape == (IN // 8, OUT) and t["scales"].dtype == dtype
    if sym:  # symmetric GPTQ stores 8 as its zero point, 7 in the v1 format
        assert {int(v) for v in unpack_int32(t["qzeros"], OUT).unique()} == {7 if fmt == "gptq" else 8}
    w = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group, 1 if fmt == "gptq" else 0)
    assert w.dtype == dtype and torch.equal(w, ref)
    if desc_act and t["scales"].shape[0] > 1:  # act-order: the groups come from g_idx, not from the position
        plain = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], None, group, 1 if fmt == "gptq" else 0)
        assert not torch.equal(plain, ref)
    if fmt == "gptq":  # the zero-point convention matters: v1 bytes read as v2 are other weights
        other = dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group, 0)
        assert not torch.equal(other, ref)


def test_gptq_refuses_what_the_references_disagree_on_or_cannot_hold():
    t, _ = gptq_tensors(_weight(), 32, fmt="gptq")
    fifteen = torch.full_like(t["qzeros"], -1)  # every nibble 15
    with pytest.raises(Int4TensorError, match="zero point nibble is 15"):
        dequantize_gptq(t["qweight"], fifteen, t["scales"], t["g_idx"], 32, 1)
    with pytest.raises(Int4TensorError, match="`g_idx` holds group 3"):
        dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], torch.full((IN,), 3, dtype=torch.int32), 32, 1)
    with pytest.raises(Int4TensorError, match="`qzeros` has shape"):
        dequantize_gptq(t["qweight"], t["qzeros"][:, :2], t["scales"], None, 32, 1)
    with pytest.raises(Int4TensorError, match="Supported: torch.float16"):
        dequantize_gptq(t["qweight"], t["qzeros"], t["scales"].double(), None, 32, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_dequantizes_to_the_reference_bit_for_bit(group, dtype):
    t, ref = awq_tensors(_weight(2, OUT, 128), group, dtype)
    assert t["qweight"].shape == (128, OUT // 8)
    w = dequantize_awq(t["qweight"], t["qzeros"], t["scales"], group)
    assert w.dtype == dtype and torch.equal(w, ref)
    # the same words read in the plain order give other weights: the interleaving is what AWQ stores
    plain_q = pack_int32(unpack_int32(t["qweight"], OUT, awq_order=True))
    assert not torch.equal(dequantize_awq(plain_q, t["qzeros"], t["scales"], group), ref)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_pack_quantized_dequantizes_to_the_reference_bit_for_bit(group, sym):
    k = 128 if group != -1 else IN + 4  # per channel: inputs that end in a partial word
    t, ref = pack_quantized_tensors(_weight(3, OUT, k), group, sym)
    assert ("weight_zero_point" in t) == (not sym)
    w = dequantize_pack_quantized(t["weight_packed"], t["weight_scale"], t["weight_shape"],
                                  t.get("weight_zero_point"), group)  # fmt: skip
    assert w.dtype == torch.bfloat16 and torch.equal(w, ref)


def _ct_scheme(group: int, sym: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = dict(strategy="channel") if group == -1 else dict(strategy="group", group_size=group)
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=4, type="int", symmetric=sym,
                                                                           **strategy))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, 128, -1])
def test_compressed_tensors_packs_the_definitions_bytes_and_decompresses_to_our_weights(group, sym):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    t, ref = pack_quantized_tensors(_weight(4, OUT, 128), group, sym)
    scheme = _ct_scheme(group, sym)
    state = {"weight": ref.to(torch.float32), "weight_scale": t["weight_scale"]}
    if not sym:  # the library's zero points: signed int8, the stored nibble minus 8
        state["weight_zero_point"] = (unpack_int32(t["weight_zero_point"], OUT, dim=0) - 8).to(torch.int8)
    packed = PackedQuantizationCompressor.compress(state, scheme)
    assert torch.equal(packed["weight_packed"], t["weight_packed"])
    if not sym:
        assert torch.equal(packed["weight_zero_point"], t["weight_zero_point"])
    theirs = PackedQuantizationCompressor.decompress(packed, scheme)["weight"]
    ours = dequantize_pack_quantized(packed["weight_packed"], packed["weight_scale"], packed["weight_shape"],
                                     packed.get("weight_zero_point"), group)  # fmt: skip
    assert theirs.dtype == ours.dtype and torch.equal(theirs, ours)


# -- configs ---------------------------------------------------------------------------------------

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False,
        "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM",
       "modules_to_not_convert": ["visual", "mlp.gate"]}


def _ct(**weights) -> dict:
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128} | weights
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "format": "pack-quantized"}},
            "ignore": ["lm_head", "re:.*self_attn\\.o_proj$"]}


def test_configs_read_into_schemes_and_leave_the_not_converted_modules_alone():
    gptq = read_quantization({"quantization_config": GPTQ | {"modules_to_not_convert": ["down_proj"]}})
    s = gptq.scheme_for("model.layers.0.self_attn.q_proj")
    assert (gptq.method, gptq.format, s.layout, s.group_size, s.zero_offset) == ("gptq", "gptq", "gptq", 128, 1)
    assert gptq.scheme_for("model.layers.0.mlp.down_proj") is None and gptq.scheme_for("lm_head") is None
    v2 = read_quantization({"quantization_config": GPTQ | {"checkpoint_format": "gptq_v2", "desc_act": True,
                                                           "group_size": -1, "lm_head": True}})
    s = v2.scheme_for("lm_head")
    assert s is not None and (s.zero_offset, s.desc_act, s.group_size) == (0, True, -1)
    awq = read_quantization({"quantization_config": AWQ})
    assert awq.scheme_for("model.layers.1.mlp.up_proj").layout == "awq"
    assert awq.scheme_for("model.layers.1.mlp.gate") is None and awq.scheme_for("model.layers.1.mlp.gate_proj")
    ct = read_quantization({"quantization_config": _ct(symmetric=False)})
    s = ct.scheme_for("model.layers.0.mlp.down_proj")
    assert (ct.format, s.layout, s.symmetric, s.zero_points) == ("pack-quantized", "pack-quantized", False, True)
    assert ct.scheme_for("model.layers.0.self_attn.o_proj") is None and ct.scheme_for("lm_head") is None
    assert read_quantization({"quantization_config": _ct(strategy="channel")}).scheme_for("x.q_proj").group_size == -1
    assert (ct.describe()["schemes"][0]["symmetric"] is False
            and "pack-quantized" in ct.describe()["schemes"][0]["scheme"])


@pytest.mark.parametrize(("qc", "match"), [
    (GPTQ | {"bits": 3}, r"Unsupported GPTQ bits `3`\. Supported: 4"),
    (GPTQ | {"bits": 8}, r"Unsupported GPTQ bits `8`\. Supported: 4"),
    (GPTQ | {"group_size": 16}, r"Unsupported GPTQ group size `16`\. Supported: 32; 64; 128; -1 \(per channel\)"),
    (GPTQ | {"checkpoint_format": "marlin"}, r"`checkpoint_format` `marlin`\. Supported: gptq; gptq_v2"),
    (GPTQ | {"dynamic": {"-:.*down": {}}}, r"per-module `dynamic` overrides"),
    (AWQ | {"version": "gemv"}, r"AWQ `version` `gemv`\. Supported: gemm"),
    (AWQ | {"zero_point": False}, r"AWQ `zero_point` `False`\. Supported: true"),
    (AWQ | {"group_size": -1}, r"AWQ group size `-1`\. Supported: 32; 64; 128$"),
    (_ct(num_bits=8), r"bits `8`\. Supported: 4"),
    (_ct(strategy="tensor"), r"weight strategy of config group `group_0` `tensor`\. Supported: group; channel"),
    (_ct(group_size=256), r"group size `256`\. Supported: 32; 64; 128"),
    (_ct(actorder="group"), r"`actorder` of config group `group_0` `group`\. Supported: null; weight"),
    (_ct() | {"kv_cache_scheme": {"num_bits": 8}}, r"`kv_cache_scheme`"),
    ({"quant_method": "hqq"}, r"quantization method `hqq`\. Supported: awq; compressed-tensors; fp8; gptq"),
])
def test_unsupported_configs_are_named_errors_listing_what_is_accepted(qc, match):
    with pytest.raises(UnsupportedQuantizationError, match=match):
        read_quantization({"quantization_config": qc})


def test_w4a8_and_mixed_format_configs_are_refused():
    w4a8 = _ct()
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token"}
    with pytest.raises(UnsupportedQuantizationError, match=r"`input_activations` of config group `group_0`"):
        read_quantization({"quantization_config": w4a8})
    mixed = _ct()
    mixed["config_groups"]["fp8"] = {"targets": ["re:.*o_proj$"], "format": "float-quantized",
                                     "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
    with pytest.raises(UnsupportedQuantizationError, match=r"`fp8` beside pack-quantized ones `float-quantized`"):
        read_quantization({"quantization_config": mixed})


@pytest.mark.parametrize(("device", "kind", "words"), [
    (("cpu", None), "packed", "CPU"), (("cuda", (6, 1)), "dequantized", "below sm_75"),
    (("cuda", (7, 0)), "dequantized", "below sm_75"), (("cuda", (7, 5)), "w4a16", "sm_75"),
    (("cuda", (9, 0)), "w4a16", "sm_90"), (("cuda", (12, 0)), "w4a16", "sm_120"), (("rocm", (9, 4)), "w4a16", "ROCm"),
])
def test_every_device_names_its_execution_and_says_why(device, kind, words):
    execution = int4_execution(*device)
    assert execution.kind == kind and words in execution.reason
    assert ("dequantized at load" in execution.reason) == (kind == "dequantized")
