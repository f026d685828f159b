"""The batched sampler: one step's logits, one token per row.

Design: a few batched tensor ops in vLLM's order (logit bias -> penalties -> EOS and stop ids
banned below `min_tokens` -> grammar mask -> temperature -> min_p -> top_k -> top_p ->
log_softmax -> argmax for greedy rows, an inverse-CDF draw for sampled ones), each processor only
for the rows that ask, so constrained, penalized and plain rows share one batch; a CPU step whose
rows are all greedy and ask for no alternatives takes the same ids and logprobs from one C++ pass
(kernels_local/sampling/cpu.py). The logprob returned is the token's under the distribution it
was drawn from (workers/sampling/logprobs.py). Penalized and tempered logits are clamped to fp32's
finite range, so no accepted value overflows a row to inf. Each sampled request owns a generator
seeded from its `seed` and draws exactly one uniform number per step; every other op is row-wise,
so a row's token never depends on its batch mates. Trade-off: one tiny `torch.rand` call per
sampled row per step instead of one batched draw, which would tie each row's randomness to the
batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels_local.sampling import cpu as cpu_greedy
from workers.sampling.grammar import Grammars, apply_bitmask, fill_bitmasks
from workers.sampling.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    ban_stops,
)
from workers.sampling.logprobs import TopList, top_alternatives
from workers.sampling.params import SamplingParams

FP32_MAX = torch.finfo(torch.float32).max


class SampleRow(Protocol):
    """What the sampler needs from a sequence (the scheduler's `Sequence` provides it);
    `grammar` (an llguidance matcher, or None) is optional."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(frozen=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token
    top: list[TopList | None]  # the `params.top_n_tokens` best alternatives per row (None: not asked)


def constrained_rows(rows: Sequence[SampleRow]) -> list[tuple[object, int]]:
    """(grammar matcher, row) of the rows with a grammar."""
    return [(m, i) for i, r in enumerate(rows) if (m := getattr(r, "grammar", None)) is not None]


def grammar_bitmask(rows: Sequence[SampleRow], grammars: Grammars | None) -> torch.Tensor | None:
    """The allowed-token bitmasks of this step's rows (None when no row has a grammar). Needs
    only the grammars' state, not the logits, so the engine computes it during the forward."""
    constrained = constrained_rows(rows)
    if not constrained:
        return None
    if grammars is None:
        raise ValueError("A constrained row needs the grammar engine (`Grammars`), got `None`")
    return fill_bitmasks(grammars.executor, constrained, len(rows), grammars.vocab_size)


def processed_logits(logits: torch.Tensor, rows: Sequence[SampleRow], grammars: Grammars | None = None,
                     bitmask: torch.Tensor | None = None, eos_ids: Sequence[int] = ()) -> torch.Tensor:
    """`logits` [N, V] after every processor and warper its row asks for (steps 1 and 2 of
    `sample_tokens`), the distribution a sampled row draws from; speculative verification
    (workers/engine/speculate.py) draws from it position by position."""
    params = [r.params for r in rows]
    # 1. Processors that change the argmax, on the rows that ask for them (bias, penalties, grammar).
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalized = [i for i, p in enumerate(params) if p.penalized]
    short = [i for i, p in enumerate(params) if len(rows[i].output_ids) < p.min_tokens]
    constrained = constrained_rows(rows)
    if biased or penalized or short or constrained:
        logits = logits.clone()
        if biased:
            apply_logit_bias(logits, rows, biased)
        if penalized:
            apply_penalties(logits, rows, penalized)
        if short:
            ban_stops(logits, rows, short, eos_ids)
        if constrained:
            bitmask = grammar_bitmask(rows, grammars) if bitmask is None else bitmask
            apply_bitmask(logits, bitmask, [i for _, i in constrained], grammars.eos_token_ids)
    sampled = [i for i, p in enumerate(params) if p.do_sample]
    if sampled:
        # 2. Warpers, batched over rows; greedy rows get neutral values.
        temps = [p.temperature if p.do_sample else 1.0 for p in params]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]
            logits = logits.clamp(max=FP32_MAX)  # a huge logit over a small temperature stays finite
        min_p = [p.min_p if p.do_sample else 0.0 for p in params]
        if any(min_p):
            logits = apply_min_p(logits, min_p)
        top_k = [p.top_k if p.do_sample else 0 for p in params]
        top_p = [p.top_p if p.do_sample else 1.0 for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits


def sample_tokens(logits: torch.Tensor, rows: Sequence[SampleRow], grammars: Grammars | None = None,
                  bitmask: torch.Tensor | None = None, eos_ids: Sequence[int] = ()) -> SampleOutput:
    """One token per row of `logits` [N, V], its logprob and the asked-for alternatives
    (`bitmask`: this step's `grammar_bitmask`, when the caller computed it already; `eos_ids`:
    the model's EOS tokens, banned with `stop_token_ids` from rows short of their `min_tokens`)."""
    params = [r.params for r in rows]
    sampled = [i for i, p in enumerate(params) if p.do_sample]
    logits = processed_logits(logits, rows, grammars, bitmask, eos_ids)
    counts = [p.top_n_tokens for p in params]
    if not sampled and not any(counts) and cpu_greedy.runs(logits):  # the same ids and logprobs, no [N, V] pass
        ids, chosen = cpu_greedy.greedy(logits)
        return SampleOutput(ids.tolist(), chosen.tolist(), top_alternatives(logits, counts))
    logprobs = torch.log_softmax(logits, dim=-1)  # [N, V]
    ids = logprobs.argmax(dim=-1)  # [N]
    if sampled:
        # 3. Inverse-CDF draw with one uniform per sampled row from that row's own generator.
        u = torch.cat([torch.rand(1, generator=rows[i].generator) for i in sampled]).to(logits.device)  # [Ns]
        idx = torch.tensor(sampled, device=logits.device)
        cdf = logprobs[idx].exp().cumsum(dim=-1)  # [Ns, V]
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=cdf.shape[-1] - 1)
        ids[idx] = drawn[:, 0]
    chosen = logprobs.gather(1, ids[:, None])[:, 0]  # [N]
    # 4. The alternatives some rows asked for (one topk over those rows).
    top = top_alternatives(logprobs, counts)
    return SampleOutput(ids.tolist(), chosen.tolist(), top)


def make_generator(seed: int, skip: int = 0) -> torch.Generator:
    """A CPU generator for one request (CPU so a seed means the same draws on every device),
    past the `skip` draws of the steps a resumed request already ran (one per step, as in `sample`)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    for _ in range(skip):
        torch.rand(1, generator=g)
    return g
