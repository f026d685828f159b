"""4-bit checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) through the loader, end to end.

The checkpoints are tiny Llama, Qwen3 and Qwen3-MoE models written by transformers (`from_config`,
tests/family_checkpoints.py), their projections packed into each format by the test packers
(tests/int4_checkpoints.py), beside each its dequantized twin: the same checkpoint with the
reference weights in fp32 and no `quantization_config`. What must hold:
- every weight our loader builds from the 4-bit tensors equals the twin's bit for bit (so q/k/v and
  gate/up fuse and experts stack as for an unquantized checkpoint), and the not-converted modules
  (and the MoE router, stored unquantized) stay as stored;
- greedy tokens of our model equal transformers' on the twin in fp32;
- the summary names the execution, its reason and the bytes (stored, widened);
- a 4-bit tensor on a module the config leaves alone, a fused layer half quantized, a missing
  scale and a non-zero stray bias are named errors.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.int4_checkpoints import dequantized_twin, quantize_checkpoint
from workers.model.loader import load_model
from workers.quant.int4_pack import Int4TensorError
from workers.quant.prepare import prepare_fp8_checkpoint
from workers.quant.scheme import UnsupportedQuantizationError

pytestmark = pytest.mark.slow

# (case, format, group, symmetric, act-order, modules left unconverted, zero biases)
CASES = {
    "llama-gptq-v1-sym": ("llama", "gptq", 32, True, False, (), False),
    "qwen3-gptq-v2-asym-actorder": ("qwen3", "gptq_v2", 64, False, True, ("down_proj",), True),
    "llama-gptq-per-channel": ("llama", "gptq", -1, False, False, (), False),
    "qwen3-awq": ("qwen3", "awq", 32, False, False, ("o_proj",), False),
    "llama-ct-sym": ("llama", "pack-quantized", 32, True, False, (), False),
    "qwen3-ct-asym": ("qwen3", "pack-quantized", 64, False, False, ("o_proj",), False),
    "qwen3_moe-gptq-v2-actorder": ("qwen3_moe", "gptq_v2", 32, False, True, (), False),  # every expert in 4 bits
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-src")
    return {case: make_family_checkpoint(case, root / case) for case in ("llama", "qwen3", "qwen3_moe")}


@pytest.fixture(scope="module")
def made(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    out = {}
    for name, (case, fmt, group, sym, act, keep, bias) in CASES.items():
        ckpt, refs = quantize_checkpoint(sources[case], root / name, fmt, group, sym, act, keep, bias)
        out[name] = (ckpt, dequantized_twin(sources[case], refs, root / f"{name}-twin"), refs)
    return out


def _greedy(model, seqs: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new_tokens):
            seqs = torch.cat([seqs, model(seqs)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seqs


class _HF(torch.nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


@pytest.mark.parametrize("name", list(CASES))
def test_the_weights_we_load_equal_the_reference_dequantization_bit_for_bit(made, name):
    ckpt, twin, refs = made[name]
    lm = load_model(ckpt, "float32")
    want = load_model(twin, "float32").model.state_dict()
    got = lm.model.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    q = lm.quantization
    assert q["method"] == json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"]
    assert q["quantized_modules"] == len(refs) and q["execution"] == "dequantized" and "at load" in q["reason"]
    assert 0 < q["stored_bytes"] < q["weight_bytes"] and q["widened_bytes"] == q["weight_bytes"] - q["stored_bytes"]
    assert q["stored_bytes"] < 0.3 * q["weight_bytes"]  # 4 bits and the scales against fp32
    # the worker's fp8 step finds no fp8 layer to prepare and leaves the dequantized weights alone
    assert prepare_fp8_checkpoint(lm.model, None, "cuda", (9, 0))["layers"] == 0
    assert all(torch.equal(lm.model.state_dict()[k], v) for k, v in want.items())


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_transformers_on_the_dequantized_model(made, name):
    from transformers import AutoModelForCausalLM

    ckpt, twin, _ = made[name]
    ours = load_model(ckpt, "float32").model
    ref = _HF(AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval())
    prompts = torch.tensor([[1, 17, 400, 1023, 9], [1, 3000, 5, 77, 2048]])
    assert torch.equal(_greedy(ours, prompts, 12), _greedy(ref, prompts, 12))


def _edit_tensors(src, out, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _rename(t, old, new):
    t[new] = t.pop(old)


@pytest.mark.parametrize(("name", "edit", "error", "match"), [
    ("qwen3-gptq-v2-asym-actorder",  # down_proj is not converted, yet stored in 4 bits
     lambda t: t.__setitem__("model.layers.0.mlp.down_proj.qweight", t["model.layers.0.mlp.up_proj.qweight"].clone()),
     UnsupportedQuantizationError, r"4-bit tensor `model\.layers\.0\.mlp\.down_proj\.qweight`.*leaves"),
    ("llama-gptq-v1-sym", lambda t: t.pop("model.layers.1.self_attn.q_proj.scales"),
     Int4TensorError, r"no `model\.layers\.1\.self_attn\.q_proj\.scales`"),
    ("qwen3-gptq-v2-asym-actorder", lambda t: t["model.layers.0.mlp.up_proj.bias"].fill_(1),
     Int4TensorError, r"`model\.layers\.0\.mlp\.up_proj\.bias` is not zero"),
])
def test_bad_4bit_tensors_are_named_errors(made, tmp_path, name, edit, error, match):
    ckpt = _edit_tensors(made[name][0], tmp_path / "edited", edit)
    with pytest.raises(error, match=match):
        load_model(ckpt, "float32")


def test_a_fused_layer_half_in_4_bits_is_refused(sources, tmp_path):
    ckpt, _ = quantize_checkpoint(sources["llama"], tmp_path / "half", "awq", 32, not_convert=("k_proj",))
    with pytest.raises(UnsupportedQuantizationError, match=r"fused layer `layers\.0\.attention\.wqkv`.*k_proj"):
        load_model(ckpt, "float32")


def test_a_4bit_checkpoint_claims_no_fp8_execution(made):
    """Guards the early return for no fp8 layers in `prepare_fp8_checkpoint`: the fp8 step named
    the device's fp8 execution (`native` on sm_90) for a checkpoint that holds no fp8 layer."""
    ckpt, _, _ = made["llama-gptq-v1-sym"]
    loaded = load_model(ckpt, "float32")
    from workers.fp8.convention import choose_fp8

    conv, _ = choose_fp8("cuda", (9, 0))
    summary = prepare_fp8_checkpoint(loaded.model, conv, "cuda", (9, 0))
    assert summary["execution"] is None and summary["layers"] == 0 and "no fp8 layers" in summary["reason"]
