"""MXFP4 (`quant_method: mxfp4`, gpt-oss's experts): the format read and dequantized as transformers does.

- e2m1 values built from the definition equal transformers' `FP4_VALUES`; the codes we unpack and
  the weights we dequantize equal `convert_moe_packed_tensors` bit for bit in float32, bfloat16
  and float16, over every byte and every finite e8m0 scale (0..254);
- the config reads into an `Mxfp4Config` whose `modules_to_not_convert` matches as transformers'
  own `should_convert_module` does; any other key, a malformed list, a NaN scale or a wrong shape is
  a named error saying what is accepted; the router's check accepts the method;
- every device's execution is dequantized at load, with its reason;
- placement sizes the experts as the worker holds them: widened to the model dtype.
"""

from __future__ import annotations

import pytest
import torch

from workers.contract.checkpoint_check import check_config
from workers.quant.mxfp4 import (
    Mxfp4Config,
    Mxfp4TensorError,
    check_stored,
    dequantize,
    e2m1_values,
    mxfp4_execution,
    unpack_codes,
)
from workers.quant.registry import describe_quantization, read_quantization
from workers.quant.scheme import UnsupportedQuantizationError

transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors  # noqa: E402

GPT_OSS_QC = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _random_blocks(seed: int = 0):
    """Blocks [3, 40, 4, 16] holding every byte value, scales [3, 40, 4] holding every exponent 0..254."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    blocks[0].view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 40, 4), generator=g, dtype=torch.uint8)
    scales.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)
    return blocks, scales


def test_e2m1_values_from_the_definition_are_transformers_table():
    assert e2m1_values().tolist() == FP4_VALUES
    assert torch.signbit(e2m1_values()[8])  # code 8 is -0.0


def test_unpacked_values_equal_transformers_bit_for_bit():
    """Scales of 127 (2^0): what transformers returns is the e2m1 value of each code."""
    blocks, _ = _random_blocks()
    ones = torch.full(blocks.shape[:-1], 127, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, ones, dtype=torch.float32).transpose(1, 2)  # [E, N, K]
    ours = e2m1_values()[unpack_codes(blocks)].flatten(-2)
    assert torch.equal(ours.view(torch.int32), ref.contiguous().view(torch.int32))
    # low nibble first: byte 0x21 holds code 1 (0.5) then code 2 (1.0)
    assert unpack_codes(torch.tensor([[0x21]], dtype=torch.uint8)).tolist() == [[1, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantized_weights_equal_transformers_bit_for_bit(dtype):
    blocks, scales = _random_blocks()
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N], gpt-oss's unquantized layout
    ours = dequantize(blocks, scales, dtype).transpose(1, 2).contiguous()
    assert ours.dtype == ref.dtype and ours.shape == ref.shape == (3, 128, 40)
    assert torch.equal(ours.view(_BITS[dtype]), ref.view(_BITS[dtype]))


def test_stored_tensors_are_checked_by_name():
    blocks, scales = _random_blocks()
    check_stored("p", blocks, scales, (3, 40, 128))
    with pytest.raises(Mxfp4TensorError, match=r"`p_blocks` has shape \(3, 40, 4, 16\); .*\[3, 40, 2, 16\]"):
        check_stored("p", blocks, scales, (3, 40, 64))
    with pytest.raises(Mxfp4TensorError, match=r"`p_scales` is `torch.int32`; MXFP4 stores `torch.uint8`"):
        check_stored("p", blocks, scales.to(torch.int32), (3, 40, 128))
    with pytest.raises(Mxfp4TensorError, match=r"whole blocks of 32"):
        check_stored("p", blocks, scales, (3, 40, 100))
    nan = scales.clone()
    nan[1, 2, 3] = 255
    with pytest.raises(Mxfp4TensorError, match=r"`p_scales` holds 255, e8m0's NaN"):
        check_stored("p", blocks, nan, (3, 40, 128))


# -- the config -----------------------------------------------------------------------------------

NAMES = [
    "model.layers.0.self_attn",
    "model.layers.11.self_attn.q_proj",
    "model.layers.3.mlp.router",
    "model.layers.3.mlp.experts",
    "model.layers.1.mlp.experts",
    "model.layers.10.mlp.experts",
    "model.embed_tokens",
    "lm_head",
    "model.norm",
]


@pytest.mark.parametrize("extra", [(), ("model.layers.1.mlp.experts",), ("experts",), ("re_only.*",)])
def test_modules_to_not_convert_match_as_transformers_matches_them(extra):
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = [*GPT_OSS_QC["modules_to_not_convert"], *extra]
    quant = read_quantization({"quantization_config": {**GPT_OSS_QC, "modules_to_not_convert": patterns}})
    assert isinstance(quant, Mxfp4Config) and quant.ignore == tuple(patterns)
    for name in NAMES:
        assert quant.ignored(name) == (not should_convert_module(name, patterns)), name
    assert not quant.ignored("model.layers.3.mlp.experts") or "experts" in extra


def test_the_config_is_described_and_the_router_accepts_it():
    described = describe_quantization({"quantization_config": GPT_OSS_QC})
    assert (described["method"], described["bits"], described["schemes"][0]["group_size"]) == ("mxfp4", 4, 32)
    assert described["ignore"] == GPT_OSS_QC["modules_to_not_convert"]
    assert (
        check_config(
            {
                "architectures": ["GptOssForCausalLM"],
                "model_type": "gpt_oss",
                "quantization_config": GPT_OSS_QC,
            }
        )
        == "gpt_oss"
    )
    # transformers' load option is accepted either way: hetserve dequantizes regardless
    assert isinstance(
        read_quantization({"quantization_config": {**GPT_OSS_QC, "dequantize": True}}), Mxfp4Config
    )


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        (
            {"group_size": 64},
            r"Unsupported MXFP4 `quantization_config` key `group_size`\. Supported: `quant_method`; "
            r"`modules_to_not_convert`; `dequantize`",
        ),
        ({"bits": 4, "fmt": "e2m1"}, r"key `bits, fmt`"),
        (
            {"modules_to_not_convert": "lm_head"},
            r"MXFP4 `modules_to_not_convert` `lm_head`.*a list of module names",
        ),
        ({"modules_to_not_convert": [3]}, r"MXFP4 `modules_to_not_convert` `\[3\]`"),
        ({"dequantize": "yes"}, r"MXFP4 `dequantize` `yes`\. Supported: true; false"),
    ],
)
def test_anything_else_in_the_config_is_a_named_error(qc, match):
    with pytest.raises(UnsupportedQuantizationError, match=match):
        read_quantization({"quantization_config": {**GPT_OSS_QC, **qc}})


@pytest.mark.parametrize(
    ("device_type", "cap", "kind", "reason"),
    [
        ("cpu", None, "dequantized", "CPU: MXFP4 experts dequantized to the model dtype at load"),
        (
            "cuda",
            (7, 0),
            "dequantized",
            "sm_70: below sm_80 the fused MoE's grouped GEMM does not run in Triton",
        ),
        ("cuda", (7, 5), "dequantized", "sm_75: below sm_80"),
        (
            "cuda",
            (8, 0),
            "w4a16",
            "sm_80: MXFP4 experts kept packed (4.25 bits a weight), e2m1 decoded in registers",
        ),
        ("cuda", (9, 0), "w4a16", "sm_90: MXFP4 experts kept packed"),
        ("cuda", (12, 0), "w4a16", "sm_120: MXFP4 experts kept packed"),
        ("rocm", (9, 4), "w4a16", "ROCm: MXFP4 experts kept packed"),
        (None, None, "per device", "MXFP4 experts kept packed on CUDA from sm_80 and on ROCm"),
    ],
)
def test_each_device_runs_the_mxfp4_rule_and_says_why(device_type, cap, kind, reason):
    execution = mxfp4_execution(device_type, cap)
    assert execution.kind == kind and execution.reason.startswith(reason), execution
    if kind == "dequantized":
        assert "dequantized to the model dtype at load" in execution.reason and "widened" in execution.reason


# -- placement sizing -------------------------------------------------------------------------------


def test_mxfp4_experts_are_sized_as_each_device_holds_them(tmp_path):
    """Guards the MXFP4 terms of `need_on`: where the rule dequantizes (sm_75) the experts take the compute
    dtype (sized at the stored bytes, placement would offer a device a quarter of what the worker holds),
    where it keeps them packed (sm_90) their stored bytes; both equal what the loader then holds."""
    from tests.family_checkpoints import make_family_checkpoint
    from tests.mxfp4_checkpoints import mxfp4_checkpoint
    from workers.contract import parse_simulate
    from workers.contract.model_size import need_on, read_profile
    from workers.model.loader import load_model

    ckpt = mxfp4_checkpoint(make_family_checkpoint("gpt_oss", tmp_path / "src"), tmp_path / "mx")
    profile = read_profile(ckpt)
    assert profile.quantization == "mxfp4"
    for device in parse_simulate("sm_75,sm_90"):
        loaded = load_model(ckpt, "bfloat16", device_type=device.type, capability=tuple(device.capability))
        c = loaded.config
        # gate_up (2I x H) and down (H x I) of every expert of every layer, all in MXFP4
        assert (
            profile.mxfp4_params
            == 3 * c.num_hidden_layers * c.num_experts * c.hidden_size * c.moe_intermediate_size
        )
        unique = {t.data_ptr(): t for t in loaded.model.state_dict().values()}
        held = sum(t.numel() * t.element_size() for t in unique.values())
        assert need_on(profile, device, "bfloat16").weight_bytes == held, device
