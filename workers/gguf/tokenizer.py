"""A GGUF's `tokenizer.ggml.*` keys as a `tokenizer.json` and `tokenizer_config.json`.

Design: llama.cpp stores the vocabulary, merges (or scores), token types and special token ids as
metadata; the router and the worker both read a Hugging Face `tokenizer.json` (the `tokenizers`
library, torch-free), so the tokenizer is rebuilt once, as transformers' own GGUF conversion
builds it (the same token ids), and written beside the converted config (workers/gguf/prepare.py):
- a byte-level BPE vocabulary (`tokenizer.ggml.model` `gpt2`: Llama 3, Qwen 2/3 and most newer
  files) keeps its merges; the text is split by the regex of its `tokenizer.ggml.pre` (GPT-2's own
  where the name is not one we know, as transformers does);
- a sentencepiece vocabulary (`llama`: Llama 2, Mistral, Phi-3, Gemma) becomes a BPE with byte
  fallback over `▁`-prefixed text, its merges the file's or, where it has none, derived from the
  scores (each token's splits into two known tokens, best score first); Phi-3's spaces are all `▁`;
  Gemma's have no prefix, its runs of spaces are stored as spaces (respelled `▁`) and its merges
  follow the tokens' order in the file, not their scores.
Tokens typed control become special added tokens and user-defined ones plain added tokens, so
neither is cut into pieces; BOS/EOS are added as `tokenizer.ggml.add_bos_token` / `add_eos_token`
say (a sentencepiece vocabulary adds BOS unless told not to). The chat template is the file's
`tokenizer.chat_template`. Trade-off: other tokenizer models (unigram `t5`, `gemma4`) are
refused by name until their converters land.
"""

from __future__ import annotations

from typing import Any

from workers.gguf.files import GGUFError

TOKENIZER_MODELS = ("gpt2", "llama")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
SPACE = "\u2581"  # sentencepiece's `▁`
GEMMA = ("gemma", "gemma2", "gemma3")  # sentencepiece files spelled and ordered their own way

# how each `tokenizer.ggml.pre` splits text before byte-level BPE (the model's own pre-tokenizer regex)
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the spelling of byte-level vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """A sentencepiece vocabulary's BPE merges: every split of a token into two tokens of the
    vocabulary, ordered by the token's score (best first), then the shorter left and right parts;
    a token's own splits by their parts' ids."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges = sorted(merges, key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _byte_level(meta: dict[str, Any], tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    tok.decoder = decoders.ByteLevel()
    return tok, alphabet


def _sentencepiece(meta: dict[str, Any], tokens: list[str]):
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    arch = meta.get("general.architecture")
    if arch in GEMMA:
        return _gemma(meta, tokens)
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_scores(tokens, list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    if arch == "phi3":  # Phi-3 writes every space as `▁`, and one before the text
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    return tok, None


def _gemma(meta: dict[str, Any], tokens: list[str]):
    """Gemma's sentencepiece: a token of two or more spaces is stored as spaces and looked up as
    `▁`s; without merges in the file they come from the tokens' order (earlier first), which Gemma's
    scores do not follow; every space is a `▁`, none prepended; no prefix stripped when decoding."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    if meta.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_scores(spelled, [-float(i) for i in range(len(spelled))])
    tok = Tokenizer(BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, fuse_unk=True, unk_token="<unk>",
                        byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok, None


def build_tokenizer(meta: dict[str, Any]):
    """The `tokenizers.Tokenizer` the file's `tokenizer.ggml.*` keys describe."""
    from tokenizers import AddedToken, processors

    kind = meta.get("tokenizer.ggml.model")
    if not meta.get("tokenizer.ggml.tokens"):
        raise GGUFError("GGUF file has no tokenizer (no `tokenizer.ggml.tokens`); a file llama.cpp's converter "
                        "wrote carries one")
    if kind not in TOKENIZER_MODELS:
        raise GGUFError(f"Unsupported GGUF tokenizer model `{kind}`. Supported: {', '.join(TOKENIZER_MODELS)}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
    tok, alphabet = _byte_level(meta, tokens) if kind == "gpt2" else _sentencepiece(meta, tokens)
    # control tokens whole and special (in a byte-level vocabulary, one spelled outside the byte
    # alphabet is a mislabel: skipped)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=False)
                            if k == CONTROL and (alphabet is None or set(t) <= alphabet)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types, strict=False)
                    if k == USER_DEFINED])
    single, specials = ["$A"], []
    for flag, key, default in (("add_bos_token", "bos_token_id", kind == "llama"),
                               ("add_eos_token", "eos_token_id", False)):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if meta.get(f"tokenizer.ggml.{flag}", default) and token_id is not None:
            text = tokens[token_id]
            single = [text, *single] if flag == "add_bos_token" else [*single, text]
            specials.append((text, int(token_id)))
    if specials:
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(single + [s.replace("$A", "$B") for s in single]),
            special_tokens=specials)
    return tok


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens' texts, the BOS/EOS flags and the chat template."""
    tokens = meta.get("tokenizer.ggml.tokens") or []

    def text(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    out = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": text("bos_token_id"),
           "eos_token": text("eos_token_id"), "pad_token": text("padding_token_id"),
           "unk_token": text("unknown_token_id"),
           "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")),
           "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
           "clean_up_tokenization_spaces": False}
    if meta.get("tokenizer.chat_template"):
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out
