"""A sentencepiece GGUF vocabulary (`tokenizer.ggml.model` `llama`) gives transformers' token ids.

The vocabulary is trained here by the `tokenizers` library on the embedded model's corpus
(sentencepiece-style BPE), then written as llama.cpp writes one: `<unk>`, `<s>`, `</s>`, the 256
byte tokens `<0x00>`..`<0xFF>`, the pieces with their scores and no merges (both converters derive
them from the scores). Ours (workers/gguf/tokenizer.py) must equal transformers' own GGUF
conversion (`convert_gguf_tokenizer`) on a corpus, for Llama's Metaspace, Phi-3's normalizer and
Gemma's respelled spaces and merges by position."""

from __future__ import annotations

import pytest

from workers.contract import DEFAULT_MODEL_DIR
from workers.gguf.files import GGUFError
from workers.gguf.tokenizer import build_tokenizer, merges_from_scores

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def meta():
    from tokenizers import SentencePieceBPETokenizer

    lines = (DEFAULT_MODEL_DIR / "corpus_words.txt").read_text().splitlines()
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(lines, vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    ranked = sorted(trained.get_vocab().items(), key=lambda kv: kv[1])
    pieces = [t for t, _ in ranked if t not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    return {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def _corpus() -> list[str]:
    lines = (DEFAULT_MODEL_DIR / "heldout_sample.txt").read_text().splitlines()
    return [line for line in lines if line.strip()][:150] + [
        "  two leading spaces", "tabs\tand\nnewlines", "ünïcödé ✓ 数字 123456 don't", "<s>special</s> kept whole", " x"]


def _reference(meta: dict, arch: str):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    keys = {"model": "tokenizer_type", "tokens": "tokens", "scores": "scores", "token_type": "token_type",
            "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id"}
    tokenizer_dict = {name: meta[f"tokenizer.ggml.{key}"] for key, name in keys.items()}
    return convert_gguf_tokenizer(arch, tokenizer_dict)[0]


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_ids_match_transformers_gguf_conversion(meta, arch):
    meta = {**meta, "general.architecture": arch}
    ours, ref = build_tokenizer(meta), _reference(meta, arch)
    for line in _corpus():
        want = ref.encode(line, add_special_tokens=False)
        got = ours.encode(line, add_special_tokens=False)
        assert got.ids == want.ids, line
        assert ours.decode(got.ids) == ref.decode(want.ids)
    assert ours.encode("hello").ids[0] == 1  # BOS: a sentencepiece vocabulary adds it unless the file says not


def test_merges_come_from_the_scores_best_first(meta):
    """Best score first, then the longer left part: `abc` (-3) merges `ab`+`c` before `a`+`bc`; and on a
    real vocabulary, the same merges as transformers derives."""
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    assert merges_from_scores(tokens, [0, 0, 0, -1, -2, -3]) == [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc")]
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    want = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores, strict=True)))
    assert merges_from_scores(tokens, scores) == want


@pytest.fixture(scope="module")
def gemma_meta(meta):
    """The same pieces as Gemma's files lay them out: `<pad>`, `<eos>`, `<bos>`, `<unk>` first, runs
    of two to eight spaces stored as spaces, scores that do not follow the merge order (the file's
    order does), no merges."""
    pieces = meta["tokenizer.ggml.tokens"][259:]
    spaces = [" " * n for n in range(2, 9)]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), *spaces, *pieces]
    return {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [float((i * 7919) % 101) for i in range(len(tokens))],
            "tokenizer.ggml.token_type": [3, 3, 3, 2] + [6] * 256 + [1] * (len(spaces) + len(pieces)),
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3}


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_sentencepiece_ids_match_transformers_gguf_conversion(gemma_meta, arch):
    """Gemma's files: runs of spaces respelled, merges from the tokens' order, no prefix space (`_gemma`
    in workers/gguf/tokenizer.py) give transformers' ids and text on the corpus, where the Llama
    reading of the same file would not (scores as merge order, a prepended `▁`)."""
    meta = {**gemma_meta, "general.architecture": arch}
    ours, ref = build_tokenizer(meta), _reference(meta, arch)
    llama = build_tokenizer({**meta, "general.architecture": "llama"})
    differ = 0
    for line in _corpus() + ["a   b    c", "        eight spaces", "end  "]:
        want = ref.encode(line, add_special_tokens=False)
        got = ours.encode(line, add_special_tokens=False)
        assert got.ids == want.ids, line
        assert ours.decode(got.ids) == ref.decode(want.ids) == line, line
        differ += llama.encode(line, add_special_tokens=False).ids != want.ids
    assert differ > len(_corpus()) // 2, differ
    assert ours.encode("hello").ids[0] == 2  # BOS, as the file's sentencepiece model adds it


@pytest.mark.parametrize(("meta", "error"), [
    ({"tokenizer.ggml.model": "gpt2"}, r"no tokenizer \(no `tokenizer.ggml.tokens`\)"),
    ({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]},
     r"tokenizer model `bert`. Supported: gpt2, llama"),
])
def test_a_missing_or_unknown_tokenizer_is_named(meta, error):
    with pytest.raises(GGUFError, match=error):
        build_tokenizer(meta)
