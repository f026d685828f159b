"""Embeddings of whole texts: the decoder's last hidden states (after its final norm, as
transformers' `last_hidden_state`), pooled per text.

Poolings as sentence-transformers names them: `last` (decoder embedding models such as
Qwen3-Embedding, whose tokenizer ends each text with EOS), `mean`, `cls`; then an optional
matryoshka cut to `dimensions` and L2 normalisation, in that order, as vLLM does.
Design: each text runs the model's full causal forward on its own, without a KV cache and under
the engine's step lock, so no padding enters a state and nothing is shared with generation; the
trunk mirrors `Transformer.forward` without its head. Trade-off: a forward per text instead of a
batch through the scheduler: exact and simple, slower than a batched prefill for many short texts.
A request's texts are admitted and counted as one request of the engine (`Engine.side_work`), and
stop between two texts once their client has gone."""

from __future__ import annotations

import threading

import torch

from workers.engine.openmp import pool_released
from workers.model.attention import causal_mask

POOLINGS = ("last", "mean", "cls")


@torch.inference_mode()
def last_hidden(model, ids: list[int]) -> torch.Tensor:
    """The final norm's output for one sequence: [S, H] fp32 (`Transformer.forward` without the head)."""
    input_ids = torch.tensor([ids], dtype=torch.long, device=model.device)  # [1, S]
    seq_len = input_ids.shape[1]
    positions = torch.arange(seq_len, device=input_ids.device)
    lengths = torch.full_like(positions, seq_len)
    rope = {spec: model.rope.lookup(spec, positions, seq_len - 1, model.dtype, lengths) for spec in model.rope_specs}
    masks = {w: None if w is None or w >= seq_len else causal_mask(positions, seq_len, w) for w in model.windows}
    x = model._embed(input_ids)  # [1, S, H]
    per_layer = None if model.per_layer_inputs is None else model.per_layer_inputs(input_ids, x)
    shared = {} if model.config.kv_shared_layers else None
    for i, layer in enumerate(model.layers):
        x = layer(x, rope, masks, None if per_layer is None else per_layer[..., i, :], shared)
    return model.norm(x)[0].float()  # [S, H]


def pool(states: torch.Tensor, pooling: str, dimensions: int | None, normalize: bool) -> list[float]:
    """One text's vector from its states [S, H]."""
    if pooling == "last":
        vector = states[-1]
    elif pooling == "mean":
        vector = states.mean(dim=0)
    elif pooling == "cls":
        vector = states[0]
    else:
        raise ValueError(f"Unknown pooling `{pooling}`. Accepted: {', '.join(POOLINGS)}")
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()


def embed(engine, texts: list[list[int]], pooling: str, dimensions: int | None, normalize: bool,
          stop: threading.Event | None = None) -> list[list[float]] | None:
    """Each token sequence's vector, in the order given, or None when `stop` was set (the client
    left): checked before each text, so at most one forward outlives it. Run on a thread inside
    `engine.side_work()`: each forward holds the step lock and stamps the liveness clock."""
    model = engine.runner.model
    out: list[list[float]] = []
    with pool_released():  # this thread's OpenMP pool would slow the engine thread's regions
        for ids in texts:
            if stop is not None and stop.is_set():
                return None
            with engine._step_lock:  # one forward on the device at a time, between engine steps
                states = last_hidden(model, ids)
            engine.progress()
            engine.metrics.embedded.inc()
            out.append(pool(states, pooling, dimensions, normalize))
    return out
