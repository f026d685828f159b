"""Sampling parameters: how one request chooses its tokens, what it reports and when it stops.

`SamplingParams` is a frozen value validated once, when the worker's HTTP edge builds it from
a request (`SamplingParams.create`): every range comes from the contract's limits
(`workers/contract/limits.py`), the same numbers the router checks at its own edge, and a bad
value is a `ParameterError` that names it and what is allowed (HTTP 422). TGI semantics: any
warper (temperature != 1, top_k, top_p) turns sampling on, as `do_sample` does; a temperature
below `MIN_TEMPERATURE` means greedy (as in vLLM: dividing fp32 logits by 1e-300 gives inf
and then NaN). The trade-off: normalizing here (temperature 0 -> greedy, 0 -> off) keeps the
sampler's batched code free of special cases, at the price of the request's raw values,
which nothing after this point needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from workers.contract import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
)
from workers.sampling.grammar import GrammarSpec

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy (vLLM's `_SAMPLING_EPS`)


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
    prompt_only: bool = False  # score the prompt, generate nothing (its one drawn token is never computed)
    # vLLM's stop controls, warper and prompt alternatives (`_vllm_extras`)
    ignore_eos: bool = False  # EOS does not end the answer: it is drawn and counted like any token
    min_tokens: int = 0  # before this many tokens, EOS and `stop_token_ids` cannot be drawn, stop strings do not match
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the answer (`stop_sequence`), besides EOS
    skip_special_tokens: bool = True  # False: special tokens' text is part of the answer's text
    min_p: float = 0.0  # a sampled row drops tokens below min_p x its best token's probability (0 = off)
    prompt_top: int | None = None  # alternatives per prompt token (None: as many as `logprobs`)

    @property
    def context_tokens(self) -> int:
        """New tokens this request needs room for in the context: none when it only scores its
        prompt, whose one drawn token ends the prefill and is never fed back."""
        return 0 if self.prompt_only else self.max_new_tokens

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
        prompt_only: bool = False,
        ignore_eos: bool = False,
        min_tokens: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        min_p: float | None = None,
        prompt_top: int | None = None,
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
            raise ParameterError(f"`seed` must be an integer in [0, {MAX_SEED}], got `{seed}`")
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
                   float(frequency_penalty or 0.0), _logit_bias(logit_bias), logprobs, bool(prompt_logprobs), grammar,
                   bool(prompt_only), **_vllm_extras(n, grammar, ignore_eos, min_tokens, stop_token_ids,
                                                     skip_special_tokens, min_p, prompt_top))


def _vllm_extras(max_new_tokens: int, grammar, ignore_eos, min_tokens, stop_token_ids, skip_special_tokens, min_p,
                 prompt_top) -> dict:
    """vLLM's extra fields, checked (`ParameterError` names the bad one)."""
    if not isinstance(ignore_eos, bool) or not isinstance(skip_special_tokens, bool):
        raise ParameterError("`ignore_eos` and `skip_special_tokens` must be booleans")
    if ignore_eos and grammar is not None:
        raise ParameterError("`ignore_eos` cannot go with a grammar, which ends the output where it is complete. "
                             "Accepted: one of them")
    low = 0 if min_tokens is None else min_tokens
    if isinstance(low, bool) or not isinstance(low, int) or not 0 <= low <= max_new_tokens:
        raise ParameterError(f"`min_tokens` must be an integer in [0, {max_new_tokens}] (at most `max_new_tokens`), "
                             f"got `{low}`")
    ids = tuple(stop_token_ids or ())
    if len(ids) > MAX_STOP_SEQUENCES or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise ParameterError(f"`stop_token_ids` must be at most {MAX_STOP_SEQUENCES} token ids (integers >= 0), "
                             f"got `{list(ids)[:MAX_STOP_SEQUENCES + 1]}`")
    if min_p is not None and not (math.isfinite(min_p) and 0.0 <= min_p <= 1.0):
        raise ParameterError(f"`min_p` must be in [0, 1] (0 disables it), got `{min_p}`")
    if prompt_top is not None and (isinstance(prompt_top, bool) or not 0 <= prompt_top <= MAX_LOGPROBS):
        raise ParameterError(f"`prompt_top_n_tokens` must be an integer in [0, {MAX_LOGPROBS}], got `{prompt_top}`")
    return {"ignore_eos": ignore_eos, "min_tokens": low, "stop_token_ids": tuple(dict.fromkeys(ids)),
            "skip_special_tokens": skip_special_tokens, "min_p": float(min_p or 0.0), "prompt_top": prompt_top}


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
