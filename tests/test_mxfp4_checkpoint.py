"""A gpt-oss checkpoint with MXFP4 experts through the loader and the engine, against transformers.

The checkpoint is a tiny gpt-oss written by transformers (`from_config`, tests/family_checkpoints.py)
with its experts packed from the format's definition (tests/mxfp4_checkpoints.py); its dequantized
twin holds the experts as transformers' `convert_moe_packed_tensors` dequantizes them. What must hold:
- every weight we load equals the twin's bit for bit (in float32 and bfloat16), and transformers' own
  MXFP4 loader (`Mxfp4Config(dequantize=True)`) reads the packed checkpoint into the twin's weights;
- fp32 logits within 1e-4 of transformers running the dequantized model (eager attention), and
  greedy tokens through our engine (batched) identical to its `generate`;
- experts left unconverted by `modules_to_not_convert` load as stored;
- the summary names the execution, its reason and the bytes (stored, widened);
- MXFP4 tensors on a module the config leaves alone or on a non-expert tensor, a missing scale and a
  float16 overflow are named errors.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.mxfp4_checkpoints import dequantized_twin, mxfp4_checkpoint
from workers.model.loader import load_model
from workers.quant.mxfp4 import Mxfp4TensorError
from workers.quant.prepare import prepare_fp8_checkpoint
from workers.quant.scheme import UnsupportedQuantizationError

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
TEXT = (
    "Once upon a time there was a little fox who lived near the river, and every morning it went "
    "down to the water to look at the fish and the birds and the boats that came and went."
)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    src = make_family_checkpoint("gpt_oss", root / "src")
    ckpt = mxfp4_checkpoint(src, root / "mx")
    partial = mxfp4_checkpoint(src, root / "mx-partial", not_convert=("model.layers.1.mlp.experts",))
    return {
        "src": src,
        "ckpt": ckpt,
        "twin": dequantized_twin(ckpt, root / "twin"),
        "partial": partial,
        "partial_twin": dequantized_twin(partial, root / "partial-twin"),
    }


@pytest.fixture(scope="module")
def reference(made):
    """transformers on the MXFP4 checkpoint itself, dequantized by its own loader, fp32, eager attention."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        made["ckpt"], dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True))  # fmt: skip
    return ref.eval()


@pytest.mark.parametrize(
    ("case", "dtype"), [("ckpt", "float32"), ("ckpt", "bfloat16"), ("partial", "float32")]
)
def test_the_weights_we_load_equal_the_reference_dequantization_bit_for_bit(made, case, dtype):
    got = load_model(made[case], dtype).model.state_dict()
    want = load_model(made[{"ckpt": "twin", "partial": "partial_twin"}[case]], dtype).model.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def test_transformers_reads_the_packed_checkpoint_into_the_twins_weights(made, reference):
    twin = transformers.AutoModelForCausalLM.from_pretrained(made["twin"], dtype=torch.float32).state_dict()
    ref = reference.state_dict()
    assert sorted(ref) == sorted(twin)
    for key, value in twin.items():
        assert torch.equal(ref[key], value), key


def test_the_summary_names_the_execution_and_the_bytes(made):
    loaded = load_model(made["ckpt"], "float32")
    q = loaded.quantization
    layers = loaded.config.num_hidden_layers
    assert (q["method"], q["bits"], q["execution"]) == ("mxfp4", 4, "dequantized")
    assert "dequantized to the model dtype at load" in q["reason"] and q["quantized_modules"] == 2 * layers
    assert 0 < q["stored_bytes"] < 0.15 * q["weight_bytes"]  # 4.25 bits a weight against fp32
    assert q["widened_bytes"] == q["weight_bytes"] - q["stored_bytes"]
    # the worker's fp8 step finds no fp8 layer and leaves the dequantized experts alone
    assert prepare_fp8_checkpoint(loaded.model, None, "cuda", (9, 0))["layers"] == 0
    partial = load_model(made["partial"], "float32").quantization
    assert (
        partial["quantized_modules"] == 2 * (layers - 1) and "model.layers.1.mlp.experts" in partial["ignore"]
    )


def _prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT).ids
    return [ids[:41], ids[:24] + ids[30:44], ids[:11], ids[3:36]]


def test_logits_match_transformers_on_the_dequantized_model(made, reference):
    ours = load_model(made["ckpt"], "float32")
    prompts = _prompts(ours.tokenizer)
    ids = torch.tensor([prompts[0][:40], prompts[3][:33] + prompts[0][:7]])  # [2, 40]
    with torch.no_grad():
        want = reference(ids).logits
        got = ours.model(ids).float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_greedy_tokens_through_the_engine_equal_transformers(made, reference):
    from workers.engine.core import Engine
    from workers.engine.runner import ModelRunner
    from workers.engine.scheduler import Scheduler, SchedulerConfig
    from workers.kv.hashing import root_hash
    from workers.kv.pool import KVPool
    from workers.sampling.params import SamplingParams

    ours = load_model(made["ckpt"], "float32")
    prompts = _prompts(ours.tokenizer)
    eos = list(ours.eos_token_ids)
    with torch.no_grad():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]  # fmt: skip
    cfg = ours.config
    pool = KVPool.for_config(cfg, 256, 4, ours.dtype, state_slots=8)
    config = SchedulerConfig(
        8,
        cfg.context_length,
        256,
        4,
        2048,
        True,
        eos_token_ids=ours.eos_token_ids,
        cache_root=root_hash(cfg.architecture),
        rope=ours.model.rope_policy,
        kv_groups=pool.group_shapes,
        state_slots=0,
    )
    engine = Engine(ModelRunner(ours.model, pool, "cpu"), Scheduler(config), ours.tokenizer, max_queue=64)
    streams = [engine.submit(p, SamplingParams.create(max_new_tokens=NEW_TOKENS)) for p in prompts]
    while engine.step():
        pass
    assert [[e.token_id for e in s.events] for s in streams] == want


# -- devices that keep the experts packed ----------------------------------------------------------

SM90 = ("cuda", (9, 0))


def _packed(made, case="ckpt", dtype="float32"):
    return load_model(made[case], dtype, device_type=SM90[0], capability=SM90[1])


@pytest.mark.parametrize("case", ["ckpt", "partial"])
def test_a_w4a16_device_holds_the_stored_bytes_in_our_row_order(made, case):
    """On sm_90 the experts stay packed (`Mxfp4FusedMoE`), gate rows then up rows; dequantized, they are
    the twin's experts bit for bit; experts the config leaves alone stay a `FusedMoE`."""
    from workers.model.moe import FusedMoE
    from workers.quant.mxfp4 import dequantize
    from workers.quant.mxfp4_experts import Mxfp4FusedMoE

    lm = _packed(made, case)
    twin = load_model(made[{"ckpt": "twin", "partial": "partial_twin"}[case]], "float32").model
    for i, layer in enumerate(lm.model.layers):
        experts, want = layer.feed_forward.experts, twin.layers[i].feed_forward.experts
        if case == "partial" and i == 1:
            assert type(experts) is FusedMoE and torch.equal(experts.w_gate_up, want.w_gate_up)
            continue
        assert type(experts) is Mxfp4FusedMoE
        for name in ("w_gate_up", "w_down"):
            blocks, scales = getattr(experts, f"{name}_blocks"), getattr(experts, f"{name}_scales")
            e, n, half = blocks.shape
            got = dequantize(blocks.view(e, n, half // 16, 16), scales, torch.float32)
            assert torch.equal(got, getattr(want, name)), (i, name)
        assert torch.equal(experts.b_gate_up, want.b_gate_up) and torch.equal(experts.b_down, want.b_down)
    q = lm.quantization
    assert (q["execution"], q["widened_bytes"]) == ("w4a16", 0) and q["reason"].startswith(
        "sm_90: MXFP4 experts kept"
    )
    assert q["weight_bytes"] == q["stored_bytes"] > 0
    expert_bf16 = sum(2 * t.numel() for n, t in twin.named_parameters() if ".experts.w_" in n)
    assert q["weight_bytes"] <= 0.3 * expert_bf16 * (1 if case == "ckpt" else 3 / 4)


def test_a_w4a16_device_computes_the_dequantized_logits_bit_for_bit(made):
    """A simulated sm_90 worker's kernel layer (`Mxfp4FusedMoETritonSm90`, on CPU tensors its torch
    path) gives the logits of the experts dequantized at load, bit for bit, so a mixed host answers alike."""
    from workers.device.bind import BoundDevice
    from workers.kernelize.apply import kernelize_for_device

    lm = _packed(made)
    choices = kernelize_for_device(lm.model, BoundDevice("cuda", 0, "GPU-sim", "sim", SM90[1], 0, True))
    assert choices["Mxfp4FusedMoE"].layer == "Mxfp4FusedMoETritonSm90"
    assert type(lm.model.layers[0].feed_forward.experts.forward.__self__).__name__ == "Mxfp4FusedMoE"
    assert lm.model.layers[0].feed_forward.experts.forward.__func__.__qualname__.startswith(
        "Mxfp4FusedMoETritonSm90"
    )
    ref = load_model(made["ckpt"], "float32")
    ids = torch.tensor([_prompts(ref.tokenizer)[0][:40]])
    with torch.no_grad():
        assert torch.equal(lm.model(ids), ref.model(ids))


# -- refusals -----------------------------------------------------------------------------------------


def _edit(src, out, edit_tensors=None, edit_config=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    if edit_tensors is not None:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((out / "config.json").read_text())
        edit_config(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    return out


_E0 = "model.layers.0.mlp.experts"


@pytest.mark.parametrize(
    ("edit_tensors", "edit_config", "dtype", "error", "match"),
    [
        (
            None,
            lambda qc: qc["modules_to_not_convert"].append("model.layers.0.mlp"),
            "float32",
            UnsupportedQuantizationError,
            rf"MXFP4 tensor `{_E0}\.(down|gate_up)_proj_blocks`: the config leaves `{_E0}`",
        ),
        (
            lambda t: t.__setitem__(
                "model.layers.0.self_attn.q_proj_blocks", t[f"{_E0}.down_proj_blocks"][0].clone()
            ),
            None,
            "float32",
            UnsupportedQuantizationError,
            r"`model\.layers\.0\.self_attn\.q_proj_blocks`: .* not a stacked experts projection",
        ),
        (
            lambda t: t.pop(f"{_E0}.down_proj_scales"),
            None,
            "float32",
            Mxfp4TensorError,
            rf"`{_E0}\.down_proj` is stored in MXFP4 but the checkpoint has no `{_E0}\.down_proj_scales`",
        ),
        (
            lambda t: t[f"{_E0}.gate_up_proj_scales"].view(-1)[0].fill_(200),
            None,
            "float16",
            Mxfp4TensorError,
            rf"`{_E0}\.gate_up_proj` dequantizes beyond float16's range",
        ),
    ],
)
def test_bad_mxfp4_tensors_are_named_errors(made, tmp_path, edit_tensors, edit_config, dtype, error, match):
    ckpt = _edit(made["ckpt"], tmp_path / "edited", edit_tensors, edit_config)
    with pytest.raises(error, match=match):
        load_model(ckpt, dtype)
