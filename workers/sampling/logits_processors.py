"""Logit processors of the sampler: bias, penalties and the top_k / top_p truncation.

Design: each processor takes one step's logits `[N, V]` (float32) and the rows that ask for it,
and touches only those rows, so a batch where nobody asks pays nothing. Per-row work is a small
loop over the asking rows; the truncation is one batched `torch.topk` over the candidates, with a
full sort of the vocabulary only when they cannot decide (ties beyond them, a wider nucleus).
Semantics as vLLM and OpenAI define them: `logit_bias` first; `min_tokens` masks EOS and
`stop_token_ids` until reached; `min_p` drops tokens below min_p x the best's probability;
`repetition_penalty` (CTRL, TGI) divides a seen token's positive logit, multiplies a negative one,
prompt included; `presence_penalty` / `frequency_penalty` (OpenAI) subtract once per distinct
output token / per occurrence. Trade-off: seen-token counts are rebuilt from the token lists every
step (a `bincount` per penalized row), which needs no state beyond the sequence's own tokens, so
preemption or recomputation can never desynchronize it."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def apply_logit_bias(logits: torch.Tensor, rows: Sequence, which: list[int]) -> torch.Tensor:
    """Add each row's `params.logit_bias` ((token id, bias) pairs) to its logits, in place: one
    `index_put_` for every biased row of the step (ids are distinct within a row)."""
    row_ids, token_ids, biases = [], [], []
    for i in which:
        for token, bias in rows[i].params.logit_bias:
            row_ids.append(i)
            token_ids.append(token)
            biases.append(bias)
    index = torch.tensor([row_ids, token_ids], dtype=torch.int64, device=logits.device)  # [2, B]
    logits.index_put_((index[0], index[1]), torch.tensor(biases, dtype=logits.dtype, device=logits.device),
                      accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, rows: Sequence, which: list[int]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output only) penalties, in place."""
    vocab = logits.shape[-1]
    for i in which:
        p, row = rows[i].params, logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(rows[i].prompt_ids + rows[i].output_ids, dtype=torch.int64, device=logits.device)
            seen = seen[seen < vocab].unique()
            score = row[seen]
            rp = max(p.repetition_penalty, torch.finfo(logits.dtype).tiny)  # never 0 in fp32
            finite = torch.finfo(logits.dtype).max  # a tiny penalty must not overflow a row to inf
            row[seen] = torch.where(score < 0, score * rp, score / rp).clamp(-finite, finite)
        if (p.presence_penalty or p.frequency_penalty) and rows[i].output_ids:
            out = torch.tensor(rows[i].output_ids, dtype=torch.int64, device=logits.device)
            counts = out[out < vocab].bincount(minlength=vocab).to(logits.dtype)  # [V]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def ban_stops(logits: torch.Tensor, rows: Sequence, which: list[int], eos_ids: Sequence[int]) -> torch.Tensor:
    """`min_tokens` (vLLM): rows that have not generated that many tokens yet cannot draw EOS or
    one of their `stop_token_ids`, in place."""
    vocab = logits.shape[-1]
    for i in which:
        banned = [t for t in (*eos_ids, *rows[i].params.stop_token_ids) if t < vocab]
        if banned:
            logits[i, torch.tensor(banned, dtype=torch.int64, device=logits.device)] = -math.inf
    return logits


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """`min_p` (vLLM): drop tokens whose probability is below min_p x the row's best one's
    (rows with 0 keep everything); the best token always stays."""
    p = torch.tensor(min_p, dtype=logits.dtype, device=logits.device)[:, None]  # [N, 1]
    logprobs = torch.log_softmax(logits, dim=-1)
    floor = logprobs.max(dim=-1, keepdim=True).values + torch.log(p)  # [N, 1]; -inf where min_p is 0
    return logits.masked_fill(logprobs < floor, -math.inf)


TOP_P_CANDIDATES = 256  # top_p without top_k: the best tokens looked at before a full sort is needed


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top_k / top_p remove, per row, from one `torch.topk` over the
    candidates only: the k best of a top_k row, the `TOP_P_CANDIDATES` best of a top_p-only row.
    The full sort (`_sorted_top_k_top_p`) runs only when the candidates cannot decide: a tie with
    the k-th value beyond them, or a nucleus that holds more than them."""
    n, vocab = logits.shape
    ks = [min(k, vocab) if k > 0 else 0 for k in top_k]
    wants = [k or (min(TOP_P_CANDIDATES, vocab) if p < 1.0 else 0) for k, p in zip(ks, top_p, strict=True)]
    width = max(wants, default=0)
    if width == 0:
        return logits
    if width >= vocab:
        return _sorted_top_k_top_p(logits, top_k, top_p)
    vals, order = logits.topk(width, dim=-1)  # [N, W], best first
    remove = torch.zeros_like(vals, dtype=torch.bool)  # [N, W] in candidate order
    has_k = torch.tensor([k > 0 for k in ks], device=logits.device)  # [N]
    if any(ks):
        # 1. top_k: the k-th value's ties stay, as in HF; a tie beyond the candidates needs the sort
        kth = vals.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device)[:, None])  # [N, 1]
        kth = torch.where(has_k[:, None], kth, torch.full_like(kth, -math.inf))
        if bool(((logits >= kth).sum(dim=-1) > width).any()):
            return _sorted_top_k_top_p(logits, top_k, top_p)
        remove |= vals < kth
    if any(p < 1.0 for p in top_p):
        # 2. top_p over the kept candidates (a top_k row) or over the whole row (top_p alone)
        p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device)[:, None]  # [N, 1]
        kept = vals.masked_fill(remove, -math.inf)
        norm = torch.where(has_k, kept.logsumexp(dim=-1), logits.logsumexp(dim=-1))[:, None]  # [N, 1]
        probs = (kept - norm).exp()  # [N, W]
        total = probs.sum(dim=-1)  # [N]: the candidates' mass
        if bool(((p[:, 0] < 1.0) & ~has_k & (total < p[:, 0])).any()):
            return _sorted_top_k_top_p(logits, top_k, top_p)
        # mass of strictly better tokens; a row with p = 1 keeps all (its fp32 sum can round to 1 early)
        remove |= ((probs.cumsum(dim=-1) - probs) >= p) & (p < 1.0)
    remove[:, 0] = False  # the best token always stays, even when `p` underflows to 0 in fp32
    truncated = torch.tensor([w > 0 for w in wants], device=logits.device)[:, None]  # [N, 1]
    mask = torch.ones_like(logits, dtype=torch.bool).scatter_(1, order, remove) & truncated  # [N, V]
    return logits.masked_fill(mask, -math.inf)


def _sorted_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`apply_top_k_top_p` by one sort of the whole vocabulary (the general case)."""
    n, vocab = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)  # [N, V] in sorted order
    if any(top_k):
        k = torch.tensor([min(x, vocab) if x > 0 else vocab for x in top_k], device=logits.device)  # [N]
        kth = sorted_logits.gather(1, (k - 1)[:, None])  # [N, 1]
        remove |= sorted_logits < kth  # ties with the k-th value stay, as in HF
    if any(p < 1.0 for p in top_p):
        p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device)[:, None]  # [N, 1]
        probs = sorted_logits.masked_fill(remove, -math.inf).softmax(dim=-1)  # [N, V]
        mass_before = probs.cumsum(dim=-1) - probs  # [N, V]: mass of strictly better tokens
        remove |= (mass_before >= p) & (p < 1.0)  # p = 1: nothing, however the fp32 sum rounds
    remove[:, 0] = False  # the best token always stays, even when `p` underflows to 0 in fp32
    mask = torch.empty_like(remove).scatter_(1, order, remove)  # back to vocab order
    return logits.masked_fill(mask, -math.inf)
