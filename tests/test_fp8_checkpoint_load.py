"""Pre-quantized fp8 checkpoints read by the loader and run in each device's execution.

The checkpoints are the embedded model (a trained Llama) written by compressed-tensors itself for
each scheme it ships as a preset (`FP8_DYNAMIC`: per channel; `FP8`: per tensor with static input
scales; `FP8_BLOCK`: 128 x 128 blocks) and by the block-wise `quant_method: fp8` format's definition
(tests/fp8_checkpoints.py). What must hold:
- the weights we run equal the reference dequantization bit for bit: compressed-tensors' own
  decompressor (`FloatQuantizationCompressor.decompress`) for its format, the definition's
  `q * weight_scale_inv` per block for the other; for every execution (dequantized, weight-only,
  native) and for the CDNA3 conversion (e4m3fnuz bytes with doubled scales);
- dequantized and weight-only compute: greedy tokens identical to transformers running the
  dequantized model in fp32; native compute (activations quantized): teacher-forced agreement with
  the bf16 model of at least 0.95;
- a checkpoint whose method or scheme no layer runs fails at load with a named error listing what is
  supported.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.fp8_checkpoints import (
    block_fp8_checkpoint,
    compressed_tensors_checkpoint,
    dequantized_reference,
    reference_weights,
)
from workers.model.loader import load_model
from workers.model.weights import map_name
from workers.quant.e4m3 import dequantize_weight
from workers.quant.linear import Fp8CheckpointLinear
from workers.quant.prepare import prepare_fp8_checkpoint
from workers.quant.scheme import UnsupportedQuantizationError

pytest.importorskip("compressed_tensors")
pytestmark = pytest.mark.slow

PRESETS = ("FP8_DYNAMIC", "FP8", "FP8_BLOCK")
# (device type, capability) -> the execution the fp8 rule gives it
DEVICES = {("cpu", None): "dequantized", ("cuda", (7, 5)): "dequantized", ("cuda", (8, 0)): "weight_only",
           ("cuda", (8, 9)): "native", ("cuda", (9, 0)): "native", ("rocm", (9, 4)): "native"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    made = {p: compressed_tensors_checkpoint(root / p, p) for p in PRESETS}
    made["block"] = block_fp8_checkpoint(root / "block")
    return made


def _fused(ref: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The reference weights fused as our modules hold them: parts (q/k/v, gate/up) concatenated in order."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for hf, w in ref.items():
        ours, part = map_name(hf + ".weight", config)
        parts.setdefault(ours.removesuffix(".weight"), {})[part or 0] = w
    return {ours: torch.cat([p[i] for i in sorted(p)]) for ours, p in parts.items()}


@pytest.mark.parametrize("device", list(DEVICES), ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("preset", [*PRESETS, "block"])
def test_the_weights_we_run_equal_the_reference_dequantization_bit_for_bit(checkpoints, preset, device):
    lm = load_model(checkpoints[preset], "float32")
    summary = prepare_fp8_checkpoint(lm.model, None, *device)
    assert summary["execution"] == DEVICES[device] and summary["layers"] == 16
    assert summary["kept"] == ["output"]  # lm_head, ignored (and tied), stays in the model dtype
    ref = reference_weights(checkpoints[preset])
    assert len(ref) == 28  # 4 layers x 7 projections
    fused = _fused(ref, lm.config)
    assert sorted(fused) == sorted(n for n, m in lm.model.named_modules() if isinstance(m, Fp8CheckpointLinear))
    for name, want in fused.items():
        layer = lm.model.get_submodule(name)
        if layer.execution == "dequantized":
            w = layer.weight.to(torch.float32)
        else:  # the bytes the kernels read, in the device's flavour, times the scales they use
            w = dequantize_weight(layer.qweight, layer.weight_scale, layer.group_n, layer.group_k, layer.fp8_fmt)
        assert torch.equal(w, want), name


def test_the_cdna3_conversion_keeps_every_value_and_maps_negative_zero_to_zero(checkpoints):
    """e4m3fn bytes read as e4m3fnuz are half the value (scales doubled); 0x80, e4m3fn's -0 and
    e4m3fnuz's NaN, becomes 0: the values where the two formats differ."""
    lm = load_model(checkpoints["FP8_DYNAMIC"], "float32")
    stored = {n: m.qweight.view(torch.uint8).clone() for n, m in lm.model.named_modules()
              if isinstance(m, Fp8CheckpointLinear)}  # fmt: skip
    prepare_fp8_checkpoint(lm.model, None, "rocm", (9, 4))
    negative_zeros = 0
    for name, before in stored.items():
        layer = lm.model.get_submodule(name)
        after = layer.qweight.view(torch.uint8)
        assert layer.qweight.dtype == torch.float8_e4m3fnuz
        negative_zeros += int((before == 0x80).sum())
        assert torch.equal(after, torch.where(before == 0x80, 0, before))
        assert not torch.isnan(layer.qweight.to(torch.float32)).any()
    assert negative_zeros > 0  # the checkpoint has the byte where the formats differ


def _greedy(model, seqs: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(new_tokens):
            seqs = torch.cat([seqs, model(seqs)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seqs


def _prompts() -> torch.Tensor:
    from tests.fp8_checkpoints import calibration_ids

    return calibration_ids(64)[:, :8]  # [4, 8] held-out text


class _HF(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).logits


@pytest.mark.parametrize("device", [("cpu", None), ("cuda", (8, 0))], ids=["dequantized", "weight_only"])
@pytest.mark.parametrize("preset", PRESETS)
def test_dequantized_compute_gives_transformers_greedy_tokens(checkpoints, preset, device):
    lm = load_model(checkpoints[preset], "float32")
    prepare_fp8_checkpoint(lm.model, None, *device)
    ref = _HF(dequantized_reference(checkpoints[preset]))
    prompts = _prompts()
    assert torch.equal(_greedy(lm.model, prompts, 16), _greedy(ref, prompts, 16))


@pytest.mark.parametrize("preset", [*PRESETS, "block"])
def test_native_compute_agrees_with_the_bf16_model(checkpoints, preset, record_property):
    """Activations quantized per token, per 128-group or with the static scale, teacher-forced along
    the bf16 model's own greedy continuations (the embedded model unquantized)."""
    from workers.contract import DEFAULT_MODEL_DIR

    bf16 = load_model(DEFAULT_MODEL_DIR, "bfloat16").model
    seqs = _greedy(bf16, _prompts(), 24)
    lm = load_model(checkpoints[preset], "bfloat16")
    assert prepare_fp8_checkpoint(lm.model, None, "cuda", (9, 0))["execution"] == "native"
    with torch.no_grad():
        got = lm.model(seqs)[:, 7:-1].argmax(-1)
    agreement = float((got == seqs[:, 8:]).float().mean())
    record_property("agreement", agreement)
    assert agreement >= 0.95, agreement


def test_memory_stays_halved_where_the_bytes_are_kept(checkpoints):
    """Weight bytes of the quantized layers against the same layers in bf16: at most 0.55x on every
    device from sm_80 up (bytes plus scales), the widened size where the device dequantizes."""
    for preset in ("FP8_DYNAMIC", "FP8_BLOCK"):
        for device, execution in DEVICES.items():
            lm = load_model(checkpoints[preset], "bfloat16")
            s = prepare_fp8_checkpoint(lm.model, None, *device)
            bf16 = sum(m.in_features * m.out_features * 2 for m in lm.model.modules()
                       if isinstance(m, Fp8CheckpointLinear))  # fmt: skip
            if execution == "dequantized":
                assert bf16 <= s["weight_bytes"] <= 1.01 * bf16  # the widened weights (and the scales, 4 bytes a row)
                assert s["widened_bytes"] == s["weight_bytes"] - s["stored_bytes"] > 0
            else:
                assert s["weight_bytes"] <= 0.55 * bf16 and s["widened_bytes"] == 0, (preset, device)


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("edit,match", [
    (lambda q: q.update(quant_method="hqq"), r"Unsupported quantization method `hqq`\. Supported: "
                                             r"awq; compressed-tensors; fp8; gptq"),
    (lambda q: q["config_groups"]["group_0"].update(format="pack-quantized"),
     r"`pack-quantized`\. Supported: float-quantized; naive-quantized"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=64),
     r"weight strategy of config group `group_0` `group`\. Supported: tensor; channel; block"),
])
def test_a_checkpoint_no_layer_runs_fails_at_load_naming_it(checkpoints, tmp_path, edit, match):
    ckpt = _edited(checkpoints["FP8_DYNAMIC"], tmp_path / "edited", edit)
    with pytest.raises(UnsupportedQuantizationError, match=match):
        load_model(ckpt, "float32")
