"""Sampling parameters: how one request chooses its tokens, what it reports and when it stops.

`SamplingParams` is what the sampler, the scheduler and the output processor read: a frozen
value made once per request from the contract's `GenerationParameters`
(workers/contract/request.py), which owns every name, limit, default and the greedy
normalization. This module only converts: sequences to tuples, the logit bias to sorted pairs,
the grammar to the engine's `GrammarSpec`, and a prompt-scoring request (`max_new_tokens` 0) to
one drawn token that ends its prefill. `create(**fields)` builds one from keyword values through
the same contract, for the engine's own callers (tests, benchmarks); a bad value is a
`ParameterError` (HTTP 422) with the contract's message. Trade-off: two types for one request,
so that the sampler's hot loop reads plain attributes and the contract stays torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from workers.contract import DEFAULT_MAX_NEW_TOKENS
from workers.contract.request import GenerationParameters, Grammar
from workers.sampling.grammar import GrammarSpec, json_text


class ParameterError(ValueError):
    """A generation parameter outside its allowed range (answered with HTTP 422)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens, what it reports and when it stops (the contract's
    names; see `GenerationParameters` for each field's meaning)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # 1 when scoring only: the drawn token that ends the prefill
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted
    top_n_tokens: int | None = None
    decoder_input_details: bool = False
    grammar: GrammarSpec | None = None
    scoring_only: bool = False  # score the prompt, generate nothing (its one drawn token is never computed)
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    min_p: float = 0.0
    prompt_top_n_tokens: int | None = None

    @property
    def context_tokens(self) -> int:
        """New tokens this request needs room for in the context: none when it only scores its
        prompt, whose one drawn token ends the prefill and is never fed back."""
        return 0 if self.scoring_only else self.max_new_tokens

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @classmethod
    def from_request(cls, p: GenerationParameters) -> SamplingParams:
        """The sampler's value for a request's validated, normalized parameters."""
        return cls(
            max_new_tokens=1 if p.scoring_only else p.max_new_tokens, do_sample=p.do_sample,
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, repetition_penalty=p.repetition_penalty,
            seed=p.seed, stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            logit_bias=tuple(p.logit_bias.items()), top_n_tokens=p.top_n_tokens,
            decoder_input_details=p.decoder_input_details,
            grammar=None if p.grammar is None else grammar_spec(p.grammar), scoring_only=p.scoring_only,
            ignore_eos=p.ignore_eos, min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids,
            skip_special_tokens=p.skip_special_tokens, min_p=p.min_p, prompt_top_n_tokens=p.prompt_top_n_tokens,
        )

    @classmethod
    def create(cls, **fields) -> SamplingParams:
        """From keyword values in the contract's names (None = default): validated and normalized
        by the contract; `ParameterError` names the bad value and what is allowed. `grammar` may
        be the engine's `GrammarSpec` itself (callers that compile their own)."""
        spec = fields.get("grammar")
        if isinstance(spec, GrammarSpec):  # checked as a grammar would be, then kept as it is
            fields["grammar"] = {"type": "regex", "value": "x"}
        try:
            made = cls.from_request(GenerationParameters.create(**fields))
        except ValueError as e:
            raise ParameterError(str(e)) from None
        return replace(made, grammar=spec) if isinstance(spec, GrammarSpec) else made


def grammar_spec(g: Grammar) -> GrammarSpec:
    """The engine's grammar for a request's (already checked by the contract)."""
    if g.type == "regex":
        return GrammarSpec("regex", g.value)
    if g.type == "json_object":
        return GrammarSpec("json_object")
    if g.type == "choice":
        return GrammarSpec("choice", json.dumps(g.value))
    schema = g.value["schema"] if g.type == "json_schema" else g.value
    return GrammarSpec("json_schema", json_text(schema), g.strict)
