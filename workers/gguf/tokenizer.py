"""A GGUF's `tokenizer.ggml.*` keys as a `tokenizer.json` and `tokenizer_config.json`.

Design: llama.cpp stores the vocabulary, merges, token types and special token ids as metadata;
the router and the worker both read a Hugging Face `tokenizer.json` (the `tokenizers` library,
torch-free), so the tokenizer is rebuilt once, as transformers' own GGUF conversion builds it, and
written beside the converted config (workers/gguf/prepare.py). A byte-level BPE vocabulary
(`tokenizer.ggml.model` `gpt2`: Llama 3, Qwen 2/3 and most newer files) keeps its merges; the
text is split by the regex of its `tokenizer.ggml.pre` (GPT-2's own where the name is not one we
know, as transformers does); tokens typed control become special added tokens and user-defined
ones plain added tokens, so neither is cut into pieces; BOS/EOS are added as
`tokenizer.ggml.add_bos_token` / `add_eos_token` say. The chat template is the file's
`tokenizer.chat_template`. Trade-off: sentencepiece vocabularies (`llama`) are refused by name until
their converter lands, rather than approximated.
"""

from __future__ import annotations

from typing import Any

from workers.gguf.files import GGUFError

TOKENIZER_MODELS = ("gpt2",)
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

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


def build_tokenizer(meta: dict[str, Any]):
    """The `tokenizers.Tokenizer` the file's `tokenizer.ggml.*` keys describe."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise GGUFError(f"Unsupported GGUF tokenizer model `{kind}`. Supported: {', '.join(TOKENIZER_MODELS)}")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [])
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
    # control tokens whole and special (one spelled outside the byte alphabet is a mislabel: skipped)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=False)
                            if k == CONTROL and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types, strict=False)
                    if k == USER_DEFINED])
    single, specials = ["$A"], []
    for flag, key, default in (("add_bos_token", "bos_token_id", False), ("add_eos_token", "eos_token_id", False)):
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
           "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
           "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
           "clean_up_tokenization_spaces": False}
    if meta.get("tokenizer.chat_template"):
        out["chat_template"] = meta["tokenizer.chat_template"]
    return out
