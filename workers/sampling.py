"""Sampling parameters and the batched sampler.

Design: `SamplingParams` is a frozen value validated once at the HTTP edge (TGI semantics:
any warper — temperature != 1, top_k, top_p — turns sampling on, as `do_sample` does).
The sampler turns one step's logits `[N, V]` into one token per row with a few batched
tensor ops, in vLLM's order: logit bias -> penalties (repetition, presence, frequency) ->
grammar mask -> temperature -> top_k -> top_p -> log_softmax -> argmax for greedy rows,
inverse-CDF draw for sampled rows. Each processor runs only when a row asks for it
(`workers/logits_processors.py`, `workers/grammar.py`), so constrained, penalized and plain
rows share one batch and a plain batch pays nothing for the others.

Determinism: each sampled request owns a `torch.Generator` seeded from its `seed`, and draws
exactly one uniform number from it per step. Every other op is row-wise, so a row's token
depends only on its own logits and its own generator, never on its batch mates.
Trade-off: one tiny `torch.rand` call per sampled row per step (a few microseconds) instead
of one batched draw, which would tie each row's randomness to the batch composition.

The logprob returned (and the top alternatives, `logprobs`) is the token's log-probability
under the distribution it was drawn from: after bias, mask, penalties and warpers (vLLM's
`processed_logprobs`, TGI's choice; see `workers/logprobs.py`).

Finite for every accepted value: a temperature below `MIN_TEMPERATURE` means greedy (as in
vLLM; dividing fp32 logits by 1e-300 gives inf and then NaN), and the penalized and
tempered logits are clamped to fp32's finite range, so a tiny `repetition_penalty` cannot
overflow a row to inf (whose softmax is NaN).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from workers.contract import MAX_LOGPROBS, MAX_STOP_SEQUENCES
from workers.grammar import Grammars, GrammarSpec, apply_bitmask, fill_bitmasks
from workers.logits_processors import apply_logit_bias, apply_penalties, apply_top_k_top_p
from workers.logprobs import TopList, top_alternatives

DEFAULT_MAX_NEW_TOKENS = 100
MAX_SEED = 2**64 - 1
MAX_LOGIT_BIAS = 100.0  # |bias| limit, as OpenAI
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| limit, as OpenAI
MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy (vLLM's `_SAMPLING_EPS`)
FP32_MAX = torch.finfo(torch.float32).max


class ParameterError(ValueError):
    """A generation parameter outside its allowed range (answered with HTTP 422)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens, what it reports and when it stops."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = False  # effective: True when any warper asks for sampling
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_in_output: bool = True  # a matched stop string ends the text (TGI) or is cut off (OpenAI)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int | None = None  # top alternatives per token (0..MAX_LOGPROBS); None: not asked
    prompt_logprobs: bool = False  # score every prompt token (echo, decoder_input_details)
    grammar: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

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
        stop_in_output: bool = True,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: Mapping[int, float] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        grammar: GrammarSpec | None = None,
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
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if value is not None and not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ParameterError(f"`{name}` must be in [-{MAX_PENALTY}, {MAX_PENALTY}] (0 disables it), got `{value}`")
        if logprobs is not None and (isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_LOGPROBS):
            raise ParameterError(f"`top_n_tokens` must be an integer in [0, {MAX_LOGPROBS}], got `{logprobs}`")
        # TGI semantics: temperature 0 without do_sample means greedy; any warper means sampling.
        tiny = temperature is not None and 0 < temperature < MIN_TEMPERATURE  # greedy, as vLLM does
        temp = 1.0 if temperature is None or temperature == 0 or tiny else float(temperature)
        k = 0 if tiny else int(top_k or 0)
        p = 1.0 if top_p is None or tiny else float(top_p)
        sample = not tiny and (bool(do_sample) or temp != 1.0 or k > 0 or p < 1.0)
        rp = 1.0 if repetition_penalty is None else float(repetition_penalty)
        return cls(n, sample, temp, k, p, rp, seed, stops, bool(stop_in_output), float(presence_penalty or 0.0),
                   float(frequency_penalty or 0.0), _logit_bias(logit_bias), logprobs, bool(prompt_logprobs), grammar)


def _logit_bias(bias: Mapping[int, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ParameterError(f"`logit_bias` lists {len(bias)} tokens; at most {MAX_LOGIT_BIAS_TOKENS} are accepted")
    out = []
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ParameterError(f"`logit_bias` keys must be token ids (integers >= 0), got `{token}`")
        if isinstance(value, bool) or not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ParameterError(f"`logit_bias` values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got `{value}` for token `{token}`")
        if value:
            out.append((token, float(value)))
    return tuple(sorted(out))


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
    top: list[TopList | None]  # the `params.logprobs` best alternatives per row (None: not asked)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], grammars: Grammars | None = None
           ) -> tuple[list[int], list[float]]:
    """One token and its logprob per row of `logits` [N, V] (float32)."""
    out = sample_tokens(logits, rows, grammars)
    return out.token_ids, out.logprobs


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


def sample_tokens(logits: torch.Tensor, rows: Sequence[SampleRow], grammars: Grammars | None = None,
                  bitmask: torch.Tensor | None = None) -> SampleOutput:
    """One token per row of `logits` [N, V], its logprob and the asked-for alternatives
    (`bitmask`: this step's `grammar_bitmask`, when the caller computed it already)."""
    params = [r.params for r in rows]
    # 1. Processors that change the argmax, on the rows that ask for them (bias, penalties, grammar).
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    penalized = [i for i, p in enumerate(params) if p.penalized]
    constrained = constrained_rows(rows)
    if biased or penalized or constrained:
        logits = logits.clone()
        if biased:
            apply_logit_bias(logits, rows, biased)
        if penalized:
            apply_penalties(logits, rows, penalized)
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
        top_k = [p.top_k if p.do_sample else 0 for p in params]
        top_p = [p.top_p if p.do_sample else 1.0 for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
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
    top = top_alternatives(logprobs, [p.logprobs for p in params])
    return SampleOutput(ids.tolist(), chosen.tolist(), top)


def make_generator(seed: int, skip: int = 0) -> torch.Generator:
    """A CPU generator for one request (CPU so a seed means the same draws on every device),
    past the `skip` draws of the steps a resumed request already ran (one per step, as in `sample`)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    for _ in range(skip):
        torch.rand(1, generator=g)
    return g
