"""Loading Hugging Face model directories: files, tokenizer, templates, dtype choice, and the
named errors for missing files, unsupported architectures and mismatched tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from tests.checkpoints import CHAT_TEMPLATE, default_model_dir, make_checkpoint, save_hf_checkpoint
from workers.contract import dtypes
from workers.model import loader
from workers.model.families.registry import FAMILIES
from workers.model.loader import ModelLoadError, choose_dtype, load_model
from workers.model.transformer import Transformer


def _rewrite(ckpt, edit) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_load_llama_directory(tmp_path):
    ckpt = make_checkpoint(tmp_path / "tiny-llama", generation_config={"eos_token_id": [1, 2]})
    lm = load_model(ckpt)
    assert lm.config.architecture == "llama" and lm.config.num_key_value_heads == 2
    assert lm.model_id == "tiny-llama" and lm.model_dir == ckpt.resolve()
    assert lm.dtype == torch.float32 and "checkpoint is float32" in lm.dtype_reason
    assert lm.chat_template == CHAT_TEMPLATE
    assert (lm.bos_token, lm.eos_token) == ("<s>", "</s>")
    assert lm.eos_token_ids == (1, 2)  # generation_config first, then config / tokenizer eos (deduplicated)
    assert lm.generation_config["bos_token_id"] == 0
    ids = lm.tokenizer.encode("Hello, world!").ids
    assert ids[0] == 0 and lm.tokenizer.decode(ids) == "Hello, world!"
    assert not any(p.is_meta for p in lm.model.parameters())
    assert not lm.model.training


def test_sharded_equals_single_file(tmp_path):
    single = load_model(make_checkpoint(tmp_path / "one", arch="qwen2"))
    sharded_dir = make_checkpoint(tmp_path / "three", arch="qwen2", shards=3)
    assert len(json.loads((sharded_dir / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    sharded = load_model(sharded_dir)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert_close(sharded.model(ids), single.model(ids), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("saved", "requested", "bf16_cpu", "expected"),
    [("bfloat16", "auto", True, torch.bfloat16), ("bfloat16", "auto", False, torch.float32),
     ("float16", "auto", True, torch.float32), ("float32", "bfloat16", False, torch.bfloat16)],
)
def test_dtype_choice_on_cpu(tmp_path, monkeypatch, saved, requested, bf16_cpu, expected):
    """`bf16_cpu`: a CPU with (True) or without (False, AVX2 only) bfloat16 kernels."""
    monkeypatch.setattr(dtypes, "cpu_bfloat16", lambda: bf16_cpu)
    lm = load_model(make_checkpoint(tmp_path / "m", torch_dtype=saved), dtype=requested)
    assert lm.dtype == expected and lm.model.tok_embeddings.weight.dtype == expected
    assert lm.dtype_reason


def test_dtype_choice_on_gpus_and_bad_value():
    assert choose_dtype("auto", "float32", "cuda", (7, 5))[0] == torch.float16
    assert choose_dtype("auto", "float32", "cuda", (9, 0))[0] == torch.bfloat16
    assert choose_dtype("auto", "bfloat16", "cuda", (7, 5))[0] == torch.float16
    with pytest.raises(ModelLoadError, match="`int8`.*auto, bfloat16, float16, float32"):
        choose_dtype("int8", None, "cpu")


def test_tied_embeddings_ignore_lm_head(tmp_path):
    ckpt = make_checkpoint(tmp_path / "tied", tie_word_embeddings=True)
    lm = load_model(ckpt)
    assert lm.model.output.weight is lm.model.tok_embeddings.weight


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_named_with_directory(tmp_path, name):
    ckpt = make_checkpoint(tmp_path / "m")
    (ckpt / name).unlink()
    with pytest.raises(ModelLoadError, match=f"Missing `{name}`.*`{ckpt.resolve()}`"):
        load_model(ckpt)


def test_missing_shard_named(tmp_path):
    ckpt = make_checkpoint(tmp_path / "m", shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="Missing `model-00002-of-00002.safetensors`"):
        load_model(ckpt)


def test_unsupported_architecture_listed(tmp_path):
    ckpt = make_checkpoint(tmp_path / "m")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError,
                       match="`GPT2LMHeadModel`.*Gemma3ForCausalLM.*LlamaForCausalLM, "
                             "MistralForCausalLM.*Qwen3ForCausalLM"):
        load_model(ckpt)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path):
    ckpt = make_checkpoint(tmp_path / "m")
    _rewrite(ckpt, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(ModelLoadError, match=r"`model.layers.1.self_attn.k_proj.weight`.*\(16, 64\).*\(32, 64\)"):
        load_model(ckpt)


def test_missing_and_unexpected_tensors_named(tmp_path):
    ckpt = make_checkpoint(tmp_path / "m")

    def edit(t):
        del t["model.layers.0.mlp.up_proj.weight"]
        t["model.layers.0.mlp.extra.weight"] = torch.zeros(2)

    _rewrite(ckpt, edit)
    with pytest.raises(ModelLoadError, match="missing tensors `model.layers.0.mlp.up_proj.weight`.*"
                                             "unexpected tensors `model.layers.0.mlp.extra.weight`"):
        load_model(ckpt)


def test_chat_template_from_jinja_file(tmp_path):
    ckpt = make_checkpoint(tmp_path / "m", tokenizer_config={"chat_template": None})
    (ckpt / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_model(ckpt).chat_template == "{{ messages[0]['content'] }}"


def test_default_model_dir_and_clear_error_when_absent(tmp_path, monkeypatch):
    assert default_model_dir().parts[-2:] == ("workers", "default_model")
    monkeypatch.setattr(loader, "DEFAULT_MODEL_DIR", tmp_path / "default_model")
    with pytest.raises(ModelLoadError, match="embedded model is absent: `config.json`"):
        load_model(loader.DEFAULT_MODEL_DIR)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_mapped_name_is_used_once(family):
    """Each family's one HF->ours map: fused parts are distinct and cover 0..n-1 for each fused tensor
    (per expert, for stacked experts); a whole tensor or a layout change maps alone."""
    parts: dict[str, list] = {}
    for ours, part in FAMILIES[family].weights.values():
        parts.setdefault(ours, []).append(part)
    for ours, found in parts.items():
        pieces = [p[1] if isinstance(p, tuple) else p for p in found]  # (EXPERT, piece) -> piece
        alone = len(found) == 1 and (pieces[0] is None or isinstance(pieces[0], str))
        assert alone or sorted(pieces) == list(range(len(pieces))), ours


def test_export_then_load_round_trip(tmp_path):
    """What training saves (`save_hf_checkpoint`) loads back to the same logits."""
    lm = load_model(make_checkpoint(tmp_path / "src", arch="qwen2", tie_word_embeddings=True))
    out = tmp_path / "export"
    save_hf_checkpoint(lm.model, out, dtype=torch.bfloat16)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((lm.model_dir / name).read_bytes())
    again = load_model(out, dtype="bfloat16")  # as saved (`auto` widens it on an AVX2-only CPU)
    assert again.dtype == torch.bfloat16 and again.config.attention_bias
    ids = torch.tensor([[3, 4, 5]])
    model32 = Transformer.from_config(again.config, torch.float32)
    model32.load_weights({k: v.float() for k, v in again.model.state_dict().items()})
    with torch.no_grad():
        assert_close(model32(ids), lm.model(ids), rtol=0.05, atol=0.3)


def test_gpt_oss_stops_on_its_formats_end_tokens_whatever_generation_config_lists(tmp_path):
    """Guards `FORMAT_STOP_TOKENS` in `_eos_ids` (workers/model/loader.py): a gpt-oss checkpoint
    whose generation_config.json lists no eos still ends an answer at harmony's `<|return|>`
    and a tool call at `<|call|>`; a Llama whose tokenizer happens to have them does not."""
    from tokenizers import AddedToken, Tokenizer

    from tests.family_checkpoints import make_family_checkpoint

    for case, expected in (("gpt_oss", True), ("llama", False)):
        ckpt = make_family_checkpoint(case, tmp_path / case)
        tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<|return|>", "<|call|>")])
        tokenizer.save(str(ckpt / "tokenizer.json"))
        (ckpt / "generation_config.json").write_text("{}")
        ids = {tokenizer.token_to_id("<|return|>"), tokenizer.token_to_id("<|call|>")}
        assert (ids <= set(load_model(ckpt).eos_token_ids)) == expected, case
