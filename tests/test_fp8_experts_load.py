"""fp8 experts of pre-quantized mixture-of-experts checkpoints, loaded into the fused MoE layer and run
in each device's execution (issue 27's fp8 experts, issue 28's formats).

The checkpoints are tiny Qwen3-MoE and Mixtral models written by transformers (one tensor per expert
and projection on disk, as the FP8 checkpoints of Qwen3-30B-A3B ship), then quantized tensor by
tensor: by compressed-tensors' own compressor (`FP8_DYNAMIC`, per channel; routers ignored with the
`re:` patterns llm-compressor writes) and by the block-wise format's definition (128 x 128 blocks,
`weight_scale_inv`; gate and up of 32 rows each do not start on a block, so their scales are kept
per row). What must hold: every expert's weights as our layer runs them equal the reference
dequantization bit for bit (for each execution, and with the CDNA3 conversion); dequantized and
weight-only compute, through the kernel layers the mapping gives a simulated device, give
transformers' greedy tokens on the dequantized model in fp32; native compute agrees with the
unquantized model; the experts' bytes stay fp8 from sm_80 up.
"""

from __future__ import annotations

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.fp8_checkpoints import dequantized_checkpoint, quantize_checkpoint, reference_weights
from workers.device.bind import BoundDevice
from workers.kernelize.apply import kernelize_for_device
from workers.model.loader import load_model
from workers.quant.e4m3 import dequantize_weight
from workers.quant.experts import Fp8FusedMoE
from workers.quant.prepare import prepare_fp8_checkpoint

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

FAMILIES = {"qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
            "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2"))}
FORMATS = ("compressed-tensors", "block")
DEVICES = {"cpu": ("cpu", None), "sm_75": ("cuda", (7, 5)), "sm_80": ("cuda", (8, 0)), "sm_90": ("cuda", (9, 0)),
           "gfx942": ("rocm", (9, 4))}  # fmt: skip
EXECUTIONS = {"cpu": "dequantized", "sm_75": "dequantized", "sm_80": "weight_only", "sm_90": "native",
              "gfx942": "native"}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for family in FAMILIES:
        src = make_family_checkpoint(family, tmp_path_factory.mktemp(family))
        made[family, None] = src
        for fmt in FORMATS:
            q = quantize_checkpoint(src, tmp_path_factory.mktemp(f"{family}-{fmt}") / "ckpt", fmt)
            made[family, fmt] = q
            made[family, fmt, "dequantized"] = dequantized_checkpoint(q, tmp_path_factory.mktemp("deq") / "ckpt")
    return made


def _sim(device: str) -> BoundDevice:
    device_type, cap = DEVICES[device]
    return BoundDevice(device_type, 0, "GPU-sim", "sim", cap, 0, True)


def _load(ckpt, device: str, dtype: str = "float32"):
    """Loaded, kernelized for the simulated device as the worker does, and prepared by the fp8 step."""
    lm = load_model(ckpt, dtype)
    kernelize_for_device(lm.model, _sim(device))
    summary = prepare_fp8_checkpoint(lm.model, None, *DEVICES[device])
    return lm, summary


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_experts_weights_equal_the_reference_dequantization_bit_for_bit(checkpoints, family, fmt, device):
    lm, summary = _load(checkpoints[family, fmt], device)
    assert summary["execution"] == EXECUTIONS[device]
    assert summary["expert_layers"] == lm.config.num_hidden_layers - (1 if family == "qwen3_moe" else 0)
    assert summary["expert_kernel"]["layer"].startswith("Fp8FusedMoE")
    ref = reference_weights(checkpoints[family, fmt])
    prefix, (gate, up, down) = FAMILIES[family]
    checked = 0
    for name, layer in lm.model.named_modules():
        if not isinstance(layer, Fp8FusedMoE):
            continue
        i = name.split(".")[1]
        for param, groups in (("w_gate_up", layer.gate_up_groups), ("w_down", layer.down_groups)):
            for e in range(layer.num_experts):
                if layer.execution == "dequantized":
                    w = getattr(layer, param)[e].to(torch.float32)
                else:  # the bytes the kernels read, in the device's flavour, times the scales they use
                    w = dequantize_weight(getattr(layer, f"{param}_q")[e], getattr(layer, f"{param}_scale")[e],
                                          *groups, layer.fp8_fmt)  # fmt: skip
                hf = f"model.layers.{i}.{prefix}.{e}"
                want = (torch.cat([ref[f"{hf}.{gate}"], ref[f"{hf}.{up}"]]) if param == "w_gate_up"
                        else ref[f"{hf}.{down}"])  # fmt: skip
                assert torch.equal(w, want), (name, param, e)
                checked += 1
    assert checked == 2 * summary["expert_layers"] * lm.config.num_experts


def _greedy(forward, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    seqs = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            seqs = torch.cat([seqs, forward(seqs)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seqs[:, prompt.shape[1]:]


PROMPTS = torch.tensor([[1, 17, 99, 250, 3, 4, 811, 40], [1, 400, 401, 7, 8, 9, 10, 2001]])


@pytest.mark.parametrize("device", ["cpu", "sm_80"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_dequantized_and_weight_only_experts_give_transformers_greedy_tokens(checkpoints, family, fmt, device):
    """Through the kernel layers the mapping gives the device (`Fp8FusedMoE` torch, or the W8A16 layer
    whose CPU path is its reference), fp32, 24 new tokens, against transformers on the dequantized model."""
    lm, _ = _load(checkpoints[family, fmt], device)
    ref = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[family, fmt, "dequantized"],
                                                            dtype=torch.float32).eval()  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(lm.model(PROMPTS), ref(PROMPTS).logits, rtol=0, atol=1e-4)
    assert torch.equal(_greedy(lm.model, PROMPTS, 24), _greedy(lambda s: ref(s).logits, PROMPTS, 24))


@pytest.mark.parametrize("device", ["sm_90", "gfx942"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_experts_agree_with_the_unquantized_model(checkpoints, fmt, device, record_property):
    """Activations quantized per token (per channel weights) or per 128-group (blocks), teacher-forced
    along the unquantized fp32 model's own greedy continuations."""
    base = load_model(checkpoints["qwen3_moe", None], "float32").model
    seqs = torch.cat([PROMPTS, _greedy(base, PROMPTS, 24)], dim=1)
    lm, summary = _load(checkpoints["qwen3_moe", fmt], device)
    assert summary["execution"] == "native" and summary["expert_kernel"]["variant"] == "native_e4m3-triton"
    with torch.no_grad():
        got = lm.model(seqs)[:, PROMPTS.shape[1] - 1 : -1].argmax(-1)
    agreement = float((got == seqs[:, PROMPTS.shape[1]:]).float().mean())
    record_property("agreement", agreement)
    assert agreement >= 0.9, agreement


def test_the_experts_bytes_stay_fp8_from_sm80_up(checkpoints):
    """Expert layers' weight bytes against the same experts in bf16: under 0.55x where the device keeps
    the bytes (weight-only, native), the widened size, said in the summary, where it dequantizes."""
    for device, execution in EXECUTIONS.items():
        lm, s = _load(checkpoints["qwen3_moe", "block"], device, "bfloat16")
        experts = [m for m in lm.model.modules() if isinstance(m, Fp8FusedMoE)]
        bf16 = sum(m.num_experts * 3 * lm.config.hidden_size * lm.config.moe_intermediate_size * 2 for m in experts)
        held = sum(m.nbytes() for m in experts)
        if execution == "dequantized":
            assert held >= bf16 and s["widened_bytes"] > 0, device
        else:
            assert held <= 0.55 * bf16 and s["widened_bytes"] == 0, device
            assert {m.w_gate_up_q.element_size() for m in experts} == {1}


def test_experts_quantized_in_part_are_refused_naming_them(checkpoints, tmp_path):
    """A checkpoint whose config leaves one expert's projection out (an ignore entry) while its tensors
    are fp8: a named error at load, never a layer half fp8 and half read as plain weights."""
    import json
    import shutil

    from workers.quant.scheme import UnsupportedQuantizationError

    ckpt = tmp_path / "partial"
    shutil.copytree(checkpoints["qwen3_moe", "compressed-tensors"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["ignore"].append("model.layers.0.mlp.experts.3.down_proj")
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match=r"Unsupported quantized tensor "
                                                           r"`model\.layers\.0\.mlp\.experts\.3\.down_proj"):
        load_model(ckpt, "float32")


@pytest.mark.parametrize("device", ["cpu", "sm_80", "sm_90"])
def test_deterministic_mode_tiles_the_fp8_layers_so_a_row_ignores_its_batch_mates(checkpoints, device):
    """Guards `_is_projection` in workers/model/deterministic.py naming `Fp8CheckpointLinear` (and the
    experts' `row_tile`): under `--deterministic` a pre-quantized checkpoint's projections and experts
    run in fixed row tiles, so a sequence's logits are the same alone and beside others."""
    from workers.model.deterministic import enable_deterministic

    lm, _ = _load(checkpoints["qwen3_moe", "block"], device, "bfloat16")
    plan = enable_deterministic(lm.model)
    fp8 = sum(type(m).__name__ in ("Fp8CheckpointLinear", "Fp8FusedMoE") for m in lm.model.modules())
    assert plan.projections >= fp8 > 0
    batch = torch.cat([PROMPTS,
                       torch.randint(3, 4000, (5, PROMPTS.shape[1]), generator=torch.Generator().manual_seed(1))])
    with torch.no_grad():
        together, alone = lm.model(batch), lm.model(PROMPTS[:1])
    assert torch.equal(together[0], alone[0])
