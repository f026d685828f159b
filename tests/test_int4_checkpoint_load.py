"""4-bit checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) through the loader, end to end.

The checkpoints are tiny Llama, Qwen3 and Qwen3-MoE models written by transformers (`from_config`,
tests/family_checkpoints.py), their projections packed into each format by the test packers
(tests/int4_checkpoints.py), beside each its dequantized twin: the same checkpoint with the
reference weights in fp32 and no `quantization_config`. Each device's execution comes from the device
the loader is given (as a worker gives it its bound device). What must hold:
- on a device that dequantizes (sm_70), every weight our loader builds from the 4-bit tensors equals
  the twin's bit for bit (so q/k/v and gate/up fuse and experts stack as for an unquantized
  checkpoint), and the not-converted modules (and the MoE router, stored unquantized) stay as stored;
- on devices that keep 4 bits (CPU `packed`, sm_86 `w4a16` through its kernel layer), each packed
  module's weight, as its layer forms it, equals the twin's bit for bit, the logits equal the twin's
  within fp32 rounding and the 4-bit layers hold at most 0.3x their bf16 bytes;
- greedy tokens of our model equal transformers' on the twin in fp32;
- the summary names the execution, its reason and the bytes (stored, held, widened);
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
from workers.device.bind import BoundDevice
from workers.kernelize.apply import kernelize_for_device
from workers.model.loader import load_model
from workers.quant.int4_linear import Int4CheckpointLinear, runtime_weight
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


SM70, SM86 = ("cuda", (7, 0)), ("cuda", (8, 6))


def _on(device) -> dict:
    """Load as a worker bound to `device` would: its type and capability, named to the loader."""
    return {"device_type": device[0], "capability": device[1]}


@pytest.mark.parametrize("name", list(CASES))
def test_the_weights_we_load_equal_the_reference_dequantization_bit_for_bit(made, name):
    ckpt, twin, refs = made[name]
    lm = load_model(ckpt, "float32", **_on(SM70))
    want = load_model(twin, "float32").model.state_dict()
    got = lm.model.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    q = lm.quantization
    assert q["method"] == json.loads((ckpt / "config.json").read_text())["quantization_config"]["quant_method"]
    assert q["quantized_modules"] == len(refs) and q["execution"] == "dequantized" and "at load" in q["reason"]
    assert q["packed_modules"] == 0 and q["widened_modules"] > 0 and "below sm_75" in q["reason"]
    assert all(m.execution == "dequantized" for m in lm.model.modules() if isinstance(m, Int4CheckpointLinear))
    assert 0 < q["stored_bytes"] < q["weight_bytes"] and q["widened_bytes"] == q["weight_bytes"] - q["stored_bytes"]
    assert q["stored_bytes"] < 0.3 * q["weight_bytes"]  # 4 bits and the scales against fp32
    # the worker's fp8 step finds no fp8 layer to prepare and leaves the dequantized weights alone
    assert prepare_fp8_checkpoint(lm.model, None, "cuda", (9, 0))["layers"] == 0
    assert all(torch.equal(lm.model.state_dict()[k], v) for k, v in want.items())


@pytest.mark.parametrize("device", [("cpu", None), SM86], ids=["cpu-packed", "sm86-w4a16"])
@pytest.mark.parametrize("name", list(CASES))
def test_devices_that_keep_4_bits_compute_the_reference_within_fp32_rounding(made, name, device):
    ckpt, twin, refs = made[name]
    lm = load_model(ckpt, "float32", **_on(device))
    kernelize_for_device(lm.model, BoundDevice(device[0], 0, "GPU-sim", "sim", device[1], 0, device[0] != "cpu"))
    ref = load_model(twin, "float32").model
    want = ref.state_dict()
    q = lm.quantization
    assert q["execution"] == ("packed" if device[0] == "cpu" else "w4a16") and q["packed_modules"] > 0
    # 1. each packed module's weight, as its layer forms it, is the twin's bit for bit; its kernel layer runs
    layers = {n: m for n, m in lm.model.named_modules() if isinstance(m, Int4CheckpointLinear)}
    kernel = "Int4CheckpointLinear" if device[0] == "cpu" else "Int4LinearTritonSm80"
    packed = bytes4 = bytes16 = 0
    for n, m in layers.items():
        assert m.forward.__func__.__qualname__ == f"{kernel}.forward", n
        if m.execution == "dequantized":  # the named fallback: fused parts whose act-order orders differ
            assert any(f"`{n}`" in note and "g_idx differ" in note for note in q["notes"]), n
            continue
        w = runtime_weight(m.qweight, m.scales, m.zeros, m.g_idx, m.group_size, m.in_features)
        assert torch.equal(w.to(torch.float32), want[f"{n}.weight"]), n
        order = 0 if m.g_idx is None else m.g_idx.nbytes  # act-order's 4 bytes per input: 1/N per weight
        packed, bytes4, bytes16 = packed + 1, bytes4 + m.nbytes() - order, bytes16 + 2 * m.in_features * m.out_features
    assert packed == q["packed_modules"] and bytes4 <= 0.3 * bytes16
    # 2. the logits: the twin's within fp32 rounding
    ids = torch.tensor([[1, 17, 400, 1023, 9], [1, 3000, 5, 77, 2048]])
    with torch.no_grad():
        got, exp = lm.model(ids), ref(ids)
    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5 * float(exp.abs().max()))


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


def test_act_order_shared_by_fused_parts_stays_packed_through_the_kernel_layer(sources, tmp_path):
    """GPTQ writes one act-order for the projections of one input (q/k/v, gate/up): those fuse into one
    packed layer with that `g_idx`, which the W4A16 layer of a simulated sm_86 gathers; the logits equal
    the dequantized twin's within fp32 rounding and nothing is dequantized at load."""
    ckpt, refs = quantize_checkpoint(sources["llama"], tmp_path / "shared", "gptq_v2", 32, False, True,
                                     shared_order=True)  # fmt: skip
    twin = dequantized_twin(sources["llama"], refs, tmp_path / "twin")
    lm = load_model(ckpt, "float32", **_on(SM86))
    kernelize_for_device(lm.model, BoundDevice("cuda", 0, "GPU-sim", "sim", (8, 6), 0, True))
    q = lm.quantization
    assert q["widened_modules"] == 0 and q["packed_modules"] == 16 and not q["notes"], q
    fused = lm.model.get_submodule("layers.0.attention.wqkv")
    assert fused.execution == "w4a16" and fused.g_idx is not None and fused.forward.__func__.__qualname__ == (
        "Int4LinearTritonSm80.forward")
    ref = load_model(twin, "float32").model
    ids = torch.tensor([[1, 17, 400, 1023, 9], [1, 3000, 5, 77, 2048]])
    with torch.no_grad():
        got, exp = lm.model(ids), ref(ids)
    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5 * float(exp.abs().max()))


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
    from workers.quant.fp8_convention import choose_fp8

    conv, _ = choose_fp8("cuda", (9, 0))
    summary = prepare_fp8_checkpoint(loaded.model, conv, "cuda", (9, 0))
    assert summary["execution"] is None and summary["layers"] == 0 and "no fp8 layers" in summary["reason"]
