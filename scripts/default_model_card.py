"""The embedded model's card (workers/default_model/README.md), filled from measured figures.

Design: the training script measures, this module only formats, so every number in the
card comes from the run that produced the weights next to it. Trade-off: editing the card
by hand is possible but gets overwritten by the next training run.
"""

from __future__ import annotations

import math
import re
from typing import Any

PROMPTS = ("The meaning of life is", "A computer is", "Love is", "The best thing about science")
CHAT_PROMPT = "Tell me something about work."
WORDS_FILE = "corpus_words.txt"
HELDOUT_FILE = "heldout_sample.txt"
COMMAND = "python scripts/train_default_model.py"


def _bsd_notice(copyright_text: str) -> str:
    match = re.search(r"Copyright \(c\) 1991.*?SUCH DAMAGE\.", copyright_text, flags=re.DOTALL)
    return match.group(0) if match else copyright_text.strip()


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def render(f: dict[str, Any]) -> str:
    """Markdown model card from the figures dict built by train_default_model.main."""
    cfg, args = f["config"], f["args"]
    history = "\n".join(
        f"| {step} | {train:.3f} | {nll:.3f} | {math.exp(nll):.1f} |" for step, train, nll in f["history"]
    )
    packages = "\n".join(
        f"- `{name}` (sha256 `{sha}`)"
        for name, sha in zip(f["deb_name"].split(", "), f["deb_sha256"].split(", "), strict=False)
    )
    samples = "\n".join(f"- `{p}` -> `{t!r}`" for p, t in f["samples"].items())
    return f"""---
license: apache-2.0
language: en
pipeline_tag: text-generation
tags: [llama, tiny, hetserve]
---

# hetserve default model: a {f['parameters'] / 1e6:.1f}M-parameter Llama trained on fortune cookies

The model `hetserve serve` runs when no `--model` is given, so a fresh install serves real
text with no network. It is an ordinary Hugging Face Llama checkpoint, loaded through the
same loader as any other model directory. It writes English-looking quips, not sense:
use `--model DIR` for anything real.

## Model

| | |
|---|---|
| architecture | `LlamaForCausalLM` (RMSNorm, SwiGLU, RoPE θ={cfg.rope_theta:g}, grouped-query attention) |
| parameters | {f['parameters']:,} (embeddings tied with the output layer) |
| layers / hidden / intermediate | {cfg.num_hidden_layers} / {cfg.hidden_size} / {cfg.intermediate_size} |
| heads / KV heads / head dim | {cfg.num_attention_heads} / {cfg.num_key_value_heads} / {cfg.head_dim} |
| context | {cfg.max_position_embeddings} tokens |
| tokenizer | byte-level BPE, {cfg.vocab_size} tokens, trained on the training split |
| weights | `model.safetensors`, bfloat16, {f['weight_bytes'] / 1e6:.1f} MB |

## Training data

The English fortune cookie files of BSD `fortune` (fortune-mod 1.99.1), taken from
Debian's packages `fortunes-min` and `fortunes`:

{packages}

Only the files of the original BSD distribution are used (art,
computers, cookie, definitions, drugs, education, ethnic, food, fortunes, goedel,
humorists, kids, law, linuxcookie, literature, love, magic, medicine, men-women,
miscellaneous, news, people, pets, platitudes, politics, riddles, science, songs-poems,
sports, startrek, wisdom, work, zippy). The offensive collection (a separate package) is
never fetched; files added later by others, ASCII art and the non-English file are left
out. Fortunes are cleaned (overstrike removed, whitespace collapsed, entries over 1,200
characters or mostly non-letters dropped) and de-duplicated.

- {f['train_fortunes']:,} training fortunes ({f['corpus_chars']:,} characters, {f['train_tokens']:,} tokens),
  {f['heldout_fortunes']:,} held out (5%, seeded shuffle) and never seen by the tokenizer or the model.
- 30% of the training fortunes (and every `Q: ... A: ...` riddle) are wrapped in the chat
  template: a user asks about the file's topic ("Tell me something about love."), the
  assistant answers with the fortune.
- Licence of the text: BSD (notice below). `{WORDS_FILE}` (the {f['vocab_words']:,} distinct
  lower-case words of the training text) and `{HELDOUT_FILE}` (the first
  {f['sample_fortunes']} held-out fortunes) are derived from it and used by the tests.

## Training

```
{COMMAND}
```

Seed {args['seed']}; {f['steps']} steps of {args['batch_size']} x {args['seq_len']} packed tokens
({f['tokens_seen']:,} tokens, {args['epochs']:g} epochs); AdamW (β=0.9/0.95, weight decay
{args['weight_decay']:g}), peak learning rate {args['lr']:g} with {args['warmup']} warm-up steps and cosine
decay to {args['lr'] * args['min_lr_ratio']:g}; gradient clipping 1.0; bf16 autocast with fp32 master
weights. Trained with hetserve's own `workers.model.Transformer` on {f['threads']} CPU threads
(torch {f['torch']}): training took {_minutes(f['train_seconds'])}
({f['tokens_seen'] / f['train_seconds']:,.0f} tokens/s on average, on 2 cores shared with other jobs),
the whole script {_minutes(f['total_seconds'])}. The script downloads the corpus itself with
`apt-get download` (run `apt-get update` first; `--fortunes-dir DIR` reads an unpacked copy).

| step | train loss | held-out loss (200 fortunes) | perplexity |
|---|---|---|---|
{history}

## Evaluation

Next-token loss on the {f['heldout_fortunes']} held-out fortunes ({f['heldout_tokens']:,} tokens, each
fortune scored on its own from `<|bos|>`), with this checkpoint loaded by
`workers.model.loader.load_model`:

- held-out loss **{f['heldout_nll']:.3f}**, perplexity **{math.exp(f['heldout_nll']):.1f}**
  (fp32 weights before the bf16 export: loss {f['heldout_nll_fp32']:.3f});
- on `{HELDOUT_FILE}` alone: loss {f['sample_nll']:.3f}, perplexity {math.exp(f['sample_nll']):.1f}
  (tests/test_default_model.py bounds it).

Greedy samples (40 new tokens at most; `chat:` prompts go through the chat template):

{samples}

## Chat format

`tokenizer_config.json` carries the chat template: each message is
`<|role|>\\n{{content}}<|eos|>` (roles `system`, `user`, `assistant`), and a generation
prompt ends with `<|assistant|>\\n`. `<|eos|>` ends every turn and is the only stop token.
The tokenizer prepends `<|bos|>` when it encodes a prompt.

## Limitations

A few million parameters trained for minutes on 2 MB of jokes: grammar is approximate,
facts are absent, quotes may be misattributed, and it repeats itself under greedy decoding.
The training text is 1970s-1990s Usenet humour; some of it is dated.

## Licence

Weights: Apache-2.0, like hetserve. Training text (and the two derived text files here):

```
{_bsd_notice(f['copyright'])}
```
"""
