"""The embedded default model: an ordinary HF Llama directory, loaded through the one loader,
that writes corpus English and keeps its measured held-out perplexity.

Bounds come from the training run recorded in workers/default_model/README.md (held-out
sample perplexity measured there, bf16 weights on CPU); the test allows ~10% slack for
other CPUs' bf16 rounding, not for a worse model.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from tests.checkpoints import default_model_dir
from workers.contract.dtypes import cpu_bfloat16
from workers.model.loader import load_model

MODEL_DIR = default_model_dir()
# Measured by scripts/train_default_model.py on heldout_sample.txt (see the model card): 108.6.
HELDOUT_SAMPLE_PPL_BOUND = 120.0
MIN_CORPUS_WORD_SHARE = 0.8
PROMPTS = ("The meaning of life is", "A computer is", "Love is", "The best thing about science")

pytestmark = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").is_file(), reason="embedded model not trained in this tree"
)


@pytest.fixture(scope="module")
def lm():
    return load_model(default_model_dir())


def _words(text: str) -> list[str]:
    # The same word definition as scripts/prepare_corpus.py uses to write corpus_words.txt.
    return re.findall(r"[a-z]+(?:'[a-z]+)*", text.lower())


@torch.no_grad()
def _greedy(lm, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with the model's full causal forward; stops at an eos id."""
    new: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(lm.model(torch.tensor([ids + new]))[0, -1].argmax())
        if nxt in lm.eos_token_ids:
            break
        new.append(nxt)
    return new


def test_checkpoint_is_a_plain_hf_llama_directory():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md", "__init__.py"):
        assert (MODEL_DIR / name).is_file(), name
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["torch_dtype"] == "bfloat16"
    with safe_open(str(MODEL_DIR / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(n.startswith(("layers.", "tok_embeddings", "output")) for n in names)  # no internal names
    assert ("lm_head.weight" in names) != config["tie_word_embeddings"]
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 30 * 2**20


def test_loads_through_the_loader_with_its_tokens(lm):
    tok_cfg = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    # bfloat16 as stored, where this CPU computes it (workers/contract/dtypes.py)
    assert lm.model_dir == MODEL_DIR.resolve() and lm.dtype == (torch.bfloat16 if cpu_bfloat16() else torch.float32)
    assert (lm.bos_token, lm.eos_token) == (tok_cfg["bos_token"], tok_cfg["eos_token"])
    assert lm.eos_token_ids == (lm.tokenizer.token_to_id(lm.eos_token),) == (gen["eos_token_id"],)
    ids = lm.tokenizer.encode("Love is").ids
    assert ids[0] == lm.tokenizer.token_to_id(lm.bos_token) and ids.count(ids[0]) == 1
    assert lm.tokenizer.decode(ids) == "Love is"


def test_chat_template_ends_with_the_assistant_prefix(lm):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(lm.chat_template)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}]
    prompt = template.render(messages=messages, add_generation_prompt=True, bos_token=lm.bos_token)
    assert prompt == "<|system|>\nAnswer briefly.<|eos|><|user|>\nHello!<|eos|><|assistant|>\n"
    assert not template.render(messages=messages, add_generation_prompt=False).endswith("<|assistant|>\n")
    tokens = lm.tokenizer.encode(prompt).tokens
    for special in ("<|bos|>", "<|system|>", "<|user|>", "<|assistant|>"):
        assert tokens.count(special) == 1, special  # one token each, bos added once by the tokenizer
    assert tokens.count("<|eos|>") == 2


def test_heldout_perplexity_is_below_the_measured_bound(lm):
    texts = (MODEL_DIR / "heldout_sample.txt").read_text().strip().split("\n%\n")
    assert len(texts) >= 100
    corpus_words = set((MODEL_DIR / "corpus_words.txt").read_text().split())
    eos = lm.eos_token_ids[0]
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([lm.tokenizer.encode(text).ids + [eos]])  # [1, S]: bos text eos
            logits = lm.model(ids[:, :-1]).float()  # [1, S-1, V]
            total += F.cross_entropy(logits[0], ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    ppl = math.exp(total / count)
    assert ppl < HELDOUT_SAMPLE_PPL_BOUND, f"held-out perplexity {ppl:.2f} >= {HELDOUT_SAMPLE_PPL_BOUND}"
    # Held out means unseen, not out of vocabulary: most of its words are still corpus words.
    held_words = [w for t in texts for w in _words(t)]
    assert sum(w in corpus_words for w in held_words) / len(held_words) > 0.9


def test_greedy_text_is_made_of_corpus_words(lm):
    corpus_words = set((MODEL_DIR / "corpus_words.txt").read_text().split())
    assert len(corpus_words) > 10_000
    generated: list[str] = []
    for prompt in PROMPTS:
        text = lm.tokenizer.decode(_greedy(lm, lm.tokenizer.encode(prompt).ids, 32))
        generated.extend(_words(text))
    assert len(generated) >= 40, generated  # English words, not newlines or punctuation
    share = sum(w in corpus_words for w in generated) / len(generated)
    assert share >= MIN_CORPUS_WORD_SHARE, (share, generated)
    assert len(set(generated)) >= 15, generated  # not one word on repeat


def test_chat_reply_is_corpus_english_and_ends(lm):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(lm.chat_template)
    prompt = template.render(messages=[{"role": "user", "content": "Tell me something about love."}],
                             add_generation_prompt=True)
    new = _greedy(lm, lm.tokenizer.encode(prompt).ids, 120)
    words = _words(lm.tokenizer.decode(new))
    corpus_words = set((MODEL_DIR / "corpus_words.txt").read_text().split())
    assert len(words) >= 3 and sum(w in corpus_words for w in words) / len(words) >= MIN_CORPUS_WORD_SHARE
    assert len(new) < 120, "the reply never reached <|eos|>"


def test_a_copy_elsewhere_loads_and_computes_the_same(lm, tmp_path):
    """Nothing special-cases the embedded model: the same files anywhere give the same model."""
    copy = tmp_path / "fortune-llama"
    shutil.copytree(MODEL_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    other = load_model(copy)
    assert other.model_id == "fortune-llama" and other.config == lm.config
    ids = torch.tensor([lm.tokenizer.encode("The meaning of life is").ids])
    with torch.no_grad():
        torch.testing.assert_close(other.model(ids), lm.model(ids), rtol=0, atol=0)


def test_transformers_reads_the_same_checkpoint(lm):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)
    ours = load_model(MODEL_DIR, dtype="float32")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR))
    text = "A computer is"
    ids = ours.tokenizer.encode(text).ids
    assert hf_tok(text).input_ids == ids
    messages = [{"role": "user", "content": "Hello!"}]
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True).endswith("<|assistant|>\n")
    with torch.no_grad():
        torch.testing.assert_close(ours.model(torch.tensor([ids])), ref(torch.tensor([ids])).logits,
                                   rtol=1e-4, atol=1e-4)
