"""Gemma 4 beyond what every family's parity test covers (tests/test_families.py runs the
`gemma4` and `gemma4_moe` cases through logits, greedy tokens and the weight map):
- its config read as transformers reads it: both spellings of the global layers' shape, the
  defaults (head dim 512, the 5:1 pattern, the last layer forced global), KV sharing's
  producers, and the options refused by name;
- the proportional rotary's frequencies and Gemma 4's RMSNorm, against transformers' own;
- the KV cache of layers with different shapes: a group per shape, nothing for the layers that
  read another layer's KV, a budget that counts only the producers;
- the text part of a multimodal checkpoint (`Gemma4ForConditionalGeneration`), its towers skipped;
- `hetserve plan --model DIR`: each layer type's head dim, KV heads and shared layers.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.family_checkpoints import BASE, CASES, make_family_checkpoint
from workers.kv.groups import plan_groups
from workers.kv.pool import KVPool, layer_shapes
from workers.model.config import ConfigError, ModelConfig

transformers = pytest.importorskip("transformers")
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig  # noqa: E402

S, F = "sliding_attention", "full_attention"


def _hf(**options) -> dict:
    """A config.json as transformers writes it for these options."""
    return Gemma4TextConfig(**{**BASE, **options}).to_dict()


def _ours(hf: dict) -> ModelConfig:
    return ModelConfig.from_hf_config({**hf, "architectures": ["Gemma4ForCausalLM"]})


@pytest.mark.parametrize("options", [
    dict(num_hidden_layers=6, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True),
    dict(num_hidden_layers=6, global_head_dim=32, num_global_key_value_heads=1),  # no k_eq_v: heads not overridden
    dict(num_hidden_layers=7),  # the defaults: global head dim 512, one global layer in six, the last one forced
    dict(num_hidden_layers=4, layer_types=[S, F, S, S], global_head_dim=24, num_kv_shared_layers=2),
], ids=["k_eq_v", "plain", "defaults", "forced-last"])
def test_layer_shapes_and_kv_sharing_read_as_transformers_reads_them(options):
    """Each layer's type, head dim and KV heads as transformers' `per_layer_config` gives them, from
    the config.json it writes (`per_layer_config`) and from the older spelling (`global_head_dim`,
    `num_global_key_value_heads`) alike; each layer's KV source as its `kv_sharing_modes`."""
    ref = Gemma4TextConfig(**{**BASE, **options})
    written = _hf(**options)
    legacy = {k: v for k, v in written.items() if k != "per_layer_config"}
    legacy.update({k: options[k] for k in ("global_head_dim", "num_global_key_value_heads") if k in options})
    modes = ref.kv_sharing_modes
    for hf in (written, legacy):
        ours = _ours(hf)
        assert list(ours.layer_types) == ref.layer_types
        for i in range(ref.num_hidden_layers):
            assert ours.layer_head_dim(i) == ref.per_layer_config[i].head_dim, i
            assert ours.layer_kv_heads(i) == ref.per_layer_config[i].num_key_value_heads, i
            assert (ours.kv_source(i) is not None) == (modes[i] == "reuse"), i
    if "num_kv_shared_layers" in options:  # layers 2 (sliding) and 3 (forced global) read 0 and 1
        assert ours.kv_sources == (0, 1, 0, 1) and ours.layer_types[-1] == F


@pytest.mark.parametrize("change,message", [
    (dict(use_bidirectional_attention="all"), "`use_bidirectional_attention: all` is not supported"),
    (dict(per_layer_config={"0": {"head_dim": 32}}), "an override of layer 0 (sliding_attention)"),
    (dict(per_layer_config={"3": {"sliding_window": 8}}), "`per_layer_config` sets `sliding_window`"),
    (dict(num_kv_shared_layers=4), "`num_kv_shared_layers` `4` must be 0..3"),
    (dict(layer_types=[S, S, F, F], num_kv_shared_layers=2, per_layer_config=None), "has no earlier layer of its type"),
    (dict(enable_moe_block=True, num_experts=None), "`enable_moe_block` needs `num_experts` `None`"),
], ids=["bidirectional", "sliding-override", "unknown-override", "all-shared", "no-producer", "moe-sizes"])
def test_what_this_server_does_not_compute_is_refused_by_name(change, message):
    hf = {**_hf(num_hidden_layers=4, layer_types=[S, S, S, F]), **change}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _ours(hf)


def test_proportional_rotary_and_the_norm_are_transformers_own():
    """Guards `_proportional` in workers/model/rope.py (its frequencies spread over the whole head
    dim, zeros past its angles: those dimensions pass through unrotated, bit for bit) and
    `PowRMSNorm` (`pow(mean + eps, -0.5)`, not `rsqrt`) against Gemma4RMSNorm in fp32 and bf16."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    from workers.model.layers import PowRMSNorm
    from workers.model.rope import RotaryTables, apply_rotary, inv_frequencies

    ref_config = Gemma4TextConfig(**{**BASE, "num_hidden_layers": 6})  # global head dim 512, factor 0.25
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](ref_config, "cpu", layer_type=F)
    spec = _ours(_hf(num_hidden_layers=6)).layer(5).rope
    got, factor = inv_frequencies(spec)
    assert spec.rotary_dim == 512 and spec.rotated_dims == 128 and factor == 1.0
    assert torch.equal(got, want)
    cos, sin = RotaryTables().lookup(spec, torch.arange(40), 39, torch.float32)
    x = torch.randn(40, 2, 512)
    rotated = apply_rotary(x, cos, sin)
    still = torch.cat((torch.arange(64, 256), torch.arange(320, 512)))  # past the angles of each half
    assert torch.equal(rotated[..., still], x[..., still]) and not torch.equal(rotated[..., :64], x[..., :64])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 7, 64, dtype=dtype) * 3
        for scale in (True, False):
            ref, ours = Gemma4RMSNorm(64, 1e-6, with_scale=scale), PowRMSNorm(64, 1e-6, with_scale=scale)
            if scale:
                with torch.no_grad():
                    ref.weight.copy_(torch.randn(64))
                    ours.weight.copy_(ref.weight)
            assert torch.equal(ours.to(dtype)(x), ref.to(dtype)(x)), (dtype, scale)


def test_the_kv_cache_holds_each_shape_once_and_counts_only_producers():
    """The `gemma4` case (layers 0 sliding and 1 global produce; 2 and 3 read their KV): a group per
    shape (sliding 2 x 16, global 1 x 32), no blocks for the readers, whose cache is their
    producer's; the bytes per token and the budget count the producers only, each in its shape."""
    cfg = _ours(_hf(**CASES["gemma4"][1]))
    shapes = layer_shapes(cfg)
    assert shapes == ((2, 16), (1, 32), None, None)
    page = KVPool.block_bytes_per_layer(cfg, torch.float32, 4)
    assert page == (2 * 2 * 16 * 4 * 4, 2 * 1 * 32 * 4 * 4, 0, 0)
    assert KVPool.bytes_per_token(cfg, torch.float32) == 2 * (2 * 16 + 32) * 4  # not 4 layers' worth
    full, sliding = plan_groups(cfg.layer_windows, page, 100_000, 4, max_sequences=2, max_batched_tokens=8,
                                shapes=shapes)
    assert (full.layers, full.kv_heads, full.head_dim) == ((1,), 1, 32)
    assert (sliding.layers, sliding.kv_heads, sliding.head_dim, sliding.window) == ((0,), 2, 16, 16)
    assert full.num_blocks == (100_000 - sliding.num_blocks * page[0]) // page[1]
    pool = KVPool.for_config(cfg, 8, 4, torch.float32, groups=(full, sliding))
    assert [t.shape for t in pool.tensors] == [(1, 2, 1, full.num_blocks, 4, 32), (1, 2, 2, sliding.num_blocks, 4, 16)]
    assert pool.nbytes == full.num_blocks * page[1] + sliding.num_blocks * page[0]
    for reader, producer in ((2, 0), (3, 1)):
        assert pool.group_of[reader] == pool.group_of[producer]
        assert pool.layer(reader).data_ptr() == pool.layer(producer).data_ptr()
    pool.write(1, torch.tensor([5]), torch.ones(1, 1, 32), torch.full((1, 1, 32), 2.0))
    assert pool.layer(3)[0, 0, 1, 1].eq(1).all() and pool.layer(3)[1, 0, 1, 1].eq(2).all()  # slot 5: block 1, offset 1


def test_the_text_part_of_a_multimodal_checkpoint_is_served_with_its_towers_skipped(tmp_path, caplog):
    """`Gemma4ForConditionalGeneration` (model type `gemma4`, the text model under `text_config`, its
    weights under `model.language_model.`, a vision tower beside them): our model is its text part,
    fp32 logits within 1e-4 of transformers' whole model on text, the tower skipped in one log line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.family_checkpoints import DEFAULT_MODEL_DIR
    from workers.model.loader import load_model

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    cfg = AutoConfig.for_model("gemma4", text_config={**BASE, **CASES["gemma4"][1]}, vision_config=vision,
                               audio_config=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Gemma4ForConditionalGeneration"
    ref.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((DEFAULT_MODEL_DIR / name).read_bytes())
    with caplog.at_level(logging.INFO, logger="workers.model.loader"):
        ours = load_model(tmp_path, "float32")
    skipped = [r.getMessage() for r in caplog.records if "Skipped" in r.getMessage()]
    assert len(skipped) == 1 and "vision_tower" in skipped[0], skipped
    assert ours.config.architecture == "gemma4" and ours.config.kv_shared_layers == 2
    ids = torch.randint(3, BASE["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(ids), ref(input_ids=ids).logits, atol=1e-4, rtol=0)


def test_plan_shows_each_layer_types_head_dim_kv_heads_and_shared_layers(tmp_path, capsys):
    from server.cli import main
    from server.commands.plan_model import render_attention

    path = make_family_checkpoint("gemma4", tmp_path / "g4")
    assert main(["plan", "--simulate", "sm_90", "--model", str(path), "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["devices"]
    full, sliding = entry["attention"]
    assert (full["layers"], full["head_dim"], full["kv_heads"], full["k_eq_v"]) == ([1, 3], 32, 1, True)
    assert (sliding["layers"], sliding["head_dim"], sliding["kv_heads"]) == ([0, 2], 16, 2)
    assert full["kv_shared_layers"] == {"3": 1} and sliding["kv_shared_layers"] == {"2": 0}
    assert "head_dim 32" in full["decode"]["reason"] and "scale 1" in full["decode"]["reason"]
    lines = render_attention(entry)  # what the text plan prints
    assert ("  attention full: layers [1, 3], head_dim 32, 1 KV heads (values = keys), layer 3 reads layer 1's KV"
            in lines)
