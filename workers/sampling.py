"""Sampling parameters and the batched sampler.

Design: `SamplingParams` is a frozen value validated once at the HTTP edge (TGI semantics:
any warper — temperature != 1, top_k, top_p — turns sampling on, as `do_sample` does).
The sampler turns one step's logits `[N, V]` into one token per row with a few batched
tensor ops: repetition penalty (only rows that ask for it) -> temperature -> top_k ->
top_p -> log_softmax -> argmax for greedy rows, inverse-CDF draw for sampled rows.

Determinism: each sampled request owns a `torch.Generator` seeded from its `seed`, and draws
exactly one uniform number from it per step. Every other op is row-wise, so a row's token
depends only on its own logits and its own generator, never on its batch mates.
Trade-off: one tiny `torch.rand` call per sampled row per step (a few microseconds) instead
of one batched draw, which would tie each row's randomness to the batch composition.

The logprob returned is the chosen token's log-probability under the distribution it was
drawn from (after penalty and warpers), as TGI reports it.

Finite for every accepted value: a temperature below `MIN_TEMPERATURE` means greedy (as in
vLLM; dividing fp32 logits by 1e-300 gives inf and then NaN), and the penalized and
tempered logits are clamped to fp32's finite range, so a tiny `repetition_penalty` cannot
overflow a row to inf (whose softmax is NaN).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

DEFAULT_MAX_NEW_TOKENS = 100
MAX_STOP_SEQUENCES = 8
MAX_SEED = 2**64 - 1
MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy (vLLM's `_SAMPLING_EPS`)
_FP32_MAX = torch.finfo(torch.float32).max


class ParameterError(ValueError):
    """A generation parameter outside its allowed range (answered with HTTP 422)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens and when it stops."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = False  # effective: True when any warper asks for sampling
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    @classmethod
    def create(
        cls,
        *,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> SamplingParams:
        """Validate raw request values (None = default) and normalize them; `ParameterError`
        names the bad value and what is allowed."""
        n = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParameterError(f"`max_new_tokens` must be an integer >= 1, got `{n}`")
        if temperature is not None and (not math.isfinite(temperature) or temperature < 0):
            raise ParameterError(f"`temperature` must be > 0 (or 0 for greedy without `do_sample`), got `{temperature}`")
        if do_sample and temperature is not None and temperature <= 0:
            raise ParameterError(f"`temperature` must be > 0 when `do_sample` is true, got `{temperature}`")
        if top_k is not None and (isinstance(top_k, bool) or top_k < 0):
            raise ParameterError(f"`top_k` must be an integer >= 0 (0 disables it), got `{top_k}`")
        if top_p is not None and not (0.0 < top_p <= 1.0):
            raise ParameterError(f"`top_p` must be in (0, 1] (1 disables it), got `{top_p}`")
        if repetition_penalty is not None and (not math.isfinite(repetition_penalty) or repetition_penalty <= 0):
            raise ParameterError(f"`repetition_penalty` must be > 0 (1 disables it), got `{repetition_penalty}`")
        if seed is not None and (isinstance(seed, bool) or not 0 <= seed <= MAX_SEED):
            raise ParameterError(f"`seed` must be an integer in [0, 2^64 - 1], got `{seed}`")
        stops = tuple(stop or ())
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ParameterError(f"`stop` accepts at most {MAX_STOP_SEQUENCES} sequences, got `{len(stops)}`")
        if any(not isinstance(s, str) or not s for s in stops):
            raise ParameterError(f"`stop` sequences must be non-empty strings, got `{list(stops)}`")
        # TGI semantics: temperature 0 without do_sample means greedy; any warper means sampling.
        if temperature is not None and 0 < temperature < MIN_TEMPERATURE:  # greedy, as vLLM does
            return cls(n, False, 1.0, 0, 1.0, 1.0 if repetition_penalty is None else float(repetition_penalty),
                       seed, stops)
        temp = 1.0 if temperature is None or temperature == 0 else float(temperature)
        k = int(top_k or 0)
        p = 1.0 if top_p is None else float(top_p)
        sample = bool(do_sample) or temp != 1.0 or k > 0 or p < 1.0
        rp = 1.0 if repetition_penalty is None else float(repetition_penalty)
        return cls(n, sample, temp, k, p, rp, seed, stops)


class SampleRow(Protocol):
    """What the sampler needs from a sequence (the scheduler's `Sequence` provides it)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SampleRow], which: list[int]) -> torch.Tensor:
    """CTRL-style penalty on every token seen so far (prompt and output), row by row."""
    logits = logits.clone()
    for i in which:
        seen = torch.tensor(rows[i].prompt_ids + rows[i].output_ids, dtype=torch.int64, device=logits.device)
        seen = seen.unique()
        rp = max(rows[i].params.repetition_penalty, torch.finfo(logits.dtype).tiny)  # never 0 in fp32
        score = logits[i, seen]
        logits[i, seen] = torch.where(score < 0, score * rp, score / rp).clamp(-_FP32_MAX, _FP32_MAX)
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top_k / top_p remove, per row, in one sort."""
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
        remove |= mass_before >= p
    remove[:, 0] = False  # the best token always stays, even when `p` underflows to 0 in fp32
    mask = torch.empty_like(remove).scatter_(1, order, remove)  # back to vocab order
    return logits.masked_fill(mask, -math.inf)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> tuple[list[int], list[float]]:
    """One token and its logprob per row of `logits` [N, V] (float32)."""
    params = [r.params for r in rows]
    # 1. Fast path: every row greedy without penalty (one argmax, one log_softmax).
    penalized = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    sampled = [i for i, p in enumerate(params) if p.do_sample]
    if penalized:
        logits = _apply_repetition_penalty(logits, rows, penalized)
    if sampled:
        # 2. Warpers, batched over rows; greedy rows get neutral values.
        temps = [p.temperature if p.do_sample else 1.0 for p in params]
        if any(t != 1.0 for t in temps):
            logits = logits / torch.tensor(temps, dtype=logits.dtype, device=logits.device)[:, None]
            logits = logits.clamp(max=_FP32_MAX)  # a huge logit over a small temperature stays finite
        top_k = [p.top_k if p.do_sample else 0 for p in params]
        top_p = [p.top_p if p.do_sample else 1.0 for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = _apply_top_k_top_p(logits, top_k, top_p)
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
    return ids.tolist(), chosen.tolist()


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator for one request (CPU so a seed means the same draws on every device)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g
