"""Tiny checkpoints whose greedy output is a fixed text: the weights edited into a lookup table.

For end-to-end tests of output parsing (reasoning, harmony) through the real router and a real
worker, where a constraint cannot force the text (the chat API takes no regular expression, and
a grammar turns reasoning parsing off). `force_outputs` edits a checkpoint that transformers
wrote (tests/family_checkpoints.py) so that greedy decoding after each given prompt writes its
given output, EOS included:
1. every attention and MLP output is zeroed, so each position's hidden state is its own
   token's embedding, and each token of the outputs gets its own embedding axis (every other
   embedding and head row is zero);
2. the head scores the next token on the current token's axis: a bigram table;
3. where one token is followed by different tokens at different places (harmony repeats
   `<|channel|>` and `<|message|>`; two conversations part after the same prompt ending), a
   `window` > 1 lets the first layer (a sliding-window layer of that width: its query is
   zero, so it averages its values over the window, and its sinks are off) add a feature of
   each "discriminating" token, one that is in that place's window and in no window of the
   places that continue otherwise; the head scores the right successor on it too.
The table is checked by simulating that arithmetic before the weights are written, so a text
it cannot force is a named error here, not a wrong answer in the test that uses it.
Trade-off: each token of the outputs takes an axis of the hidden state (64 in the tiny
checkpoints), so outputs stay short.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

SCORE = 20.0  # the head's score of the next token on the current token's axis
TIE_BREAK = 5.0  # ... and on a discriminating token's feature, per occurrence in the window (3 stay below SCORE)
_ZEROED = ("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias", "down_proj", "down_proj_bias")


def _steps(chains: list[tuple[list[int], list[int]]], window: int) -> list[tuple[int, tuple[int, ...], int]]:
    """(current token, the window's tokens ending with it, the next token) of every generated token."""
    out = []
    for prompt, output in chains:
        seq = [*prompt, *output]
        for i in range(len(prompt) - 1, len(seq) - 1):
            out.append((seq[i], tuple(seq[max(0, i - window + 1): i + 1]), seq[i + 1]))
    return out


def _table(steps, window: int) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
    """Head scores: (next, current) on the current token's axis, (next, discriminator) on its feature."""
    bigram, feature = {}, {}
    by_token = defaultdict(list)
    spread: dict[int, int] = defaultdict(int)  # in how many windows each token is (a feature's reach)
    for cur, seen, nxt in steps:
        by_token[cur].append((seen, nxt))
        bigram[(nxt, cur)] = SCORE
        for t in set(seen):
            spread[t] += 1
    for cur, places in by_token.items():
        if len({nxt for _, nxt in places}) == 1:
            continue
        for seen, nxt in places:
            others = {t for other, n in places if n != nxt for t in other}
            tells = sorted((t for t in set(seen) if t not in others), key=lambda t: (spread[t], -seen.index(t)))
            if not tells:
                raise ValueError(f"token `{cur}` is followed by different tokens after the same last {window} tokens "
                                 f"{list(seen)}. Accepted: outputs that a window of {window} tells apart (widen it)")
            feature[(nxt, tells[0])] = TIE_BREAK * window
    return bigram, feature


def _check(steps, bigram, feature, window: int) -> None:
    """Greedy choice of the table at every step, as the edited model computes it (up to the
    final norm's positive scale, which changes no argmax)."""
    for cur, seen, nxt in steps:
        scores: dict[int, float] = defaultdict(float)
        for (n, c), s in bigram.items():
            if c == cur:
                scores[n] += s
        for (n, d), s in feature.items():
            scores[n] += s * seen.count(d) / len(seen)
        best = sorted(scores.items(), key=lambda kv: -kv[1])
        runner_up = next((s for n, s in best if n != nxt), 0.0)
        if scores[nxt] - max(runner_up, 0.0) < 1.0:
            raise ValueError(f"after `{list(seen)}` the table scores {dict(best[:3])}, not `{nxt}` first. Accepted: "
                             f"outputs whose places a window of {window} tells apart with a margin")


def force_outputs(ckpt: Path, chains: list[tuple[list[int], list[int]]], window: int = 1) -> None:
    """Edit `ckpt` so that greedy decoding after each prompt (token ids, as the worker encodes
    it) writes its output (token ids, ending with an EOS token); see the module docstring."""
    import torch
    from safetensors.torch import load_file, save_file

    steps = _steps(chains, window)
    bigram, feature = _table(steps, window)
    _check(steps, bigram, feature, window)
    config = json.loads((ckpt / "config.json").read_text())
    tokens = sorted({c for _, c in bigram} | {d for _, d in feature})  # current and discriminating tokens
    features = sorted({d for _, d in feature})
    hidden = config["hidden_size"]
    if len(tokens) + len(features) > hidden:
        raise ValueError(f"{len(tokens)} tokens and {len(features)} features need more axes than the hidden size "
                         f"`{hidden}`. Accepted: shorter outputs")
    axis = {t: i for i, t in enumerate(tokens)}
    f_axis = {d: len(tokens) + i for i, d in enumerate(features)}
    weights = load_file(ckpt / "model.safetensors")
    assert "lm_head.weight" in weights, "the head must not be tied to the embeddings"
    for name, w in weights.items():
        if name.endswith(_ZEROED):
            weights[name] = torch.zeros_like(w)
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed.zero_()
    head.zero_()
    for t, i in axis.items():
        embed[t, i] = 1.0
    norm = weights["model.norm.weight"]  # the final norm's weight per axis, divided out of the scores
    for (n, c), s in bigram.items():
        head[n, axis[c]] = s / float(norm[axis[c]])
    for (n, d), s in feature.items():
        head[n, f_axis[d]] = s / float(norm[f_axis[d]])
    if features:
        _window_layer(weights, config, axis, f_axis, window)
        (ckpt / "config.json").write_text(json.dumps({**config, "sliding_window": window}, indent=2))
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})


def _window_layer(weights: dict, config: dict, axis: dict[int, int], f_axis: dict[int, int], window: int) -> None:
    """Layer 0 averages, over the last `window` tokens, one value per discriminating token and
    writes it to that token's feature axis."""
    if (config.get("layer_types") or ["?"])[0] != "sliding_attention":
        raise ValueError(f"layer 0 is `{(config.get('layer_types') or ['full'])[0]}`. Accepted: a family whose "
                         "first layer is a sliding-window one (gpt_oss)")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    group = config["num_attention_heads"] // config["num_key_value_heads"]
    if len(f_axis) > config["num_key_value_heads"] * head_dim:
        raise ValueError(f"{len(f_axis)} features exceed the values of one layer. Accepted: fewer repeated tokens")
    pre = "model.layers.0.self_attn."
    for name in ("q_proj.weight", "q_proj.bias", "v_proj.weight", "v_proj.bias"):
        if pre + name in weights:
            weights[pre + name].zero_()
    if pre + "sinks" in weights:
        weights[pre + "sinks"].fill_(-30.0)  # no weight on the sink: the window's mean, exactly
    norm = weights["model.layers.0.input_layernorm.weight"]
    scale = config["hidden_size"] ** 0.5  # a one-hot embedding's RMS-normed value, before the norm's weight
    v, o = weights[pre + "v_proj.weight"], weights[pre + "o_proj.weight"]
    for j, (token, target) in enumerate(f_axis.items()):
        kv, dim = divmod(j, head_dim)
        v[kv * head_dim + dim, axis[token]] = 1.0 / (scale * float(norm[axis[token]]))
        o[target, kv * group * head_dim + dim] = 1.0


def grow_vocab(ckpt: Path, size: int) -> None:
    """Give the checkpoint `size` embedding and head rows (a tokenizer with added tokens needs
    rows for them); the new rows are zero."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(ckpt / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = weights[name]
        weights[name] = torch.cat([w, w.new_zeros(size - w.shape[0], w.shape[1])])
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "vocab_size": size}, indent=2))
