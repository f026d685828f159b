"""The typed request: one shape of a generation request from each public edge to the sampler.

`WorkerRequest` (workers/contract/request.py) owns the names, limits, defaults and the greedy
normalization; the other bodies that cross are contract types too (workers/contract/wire.py),
the worker's routes take only those, and the router's client sends nothing else.
"""

from __future__ import annotations

import pytest

from server.dispatch.faults import fingerprint
from server.protocol.openai.requests import ChatCompletionRequest, CompletionRequest
from server.protocol.tgi import GenerateRequest
from server.routing.filter import Constraints
from server.routing.router import Router
from workers.contract import (
    MIN_TEMPERATURE,
    GenerationParameters,
    TokenizeRequest,
    WireRequest,
    WorkerRequest,
    wire_bytes,
)
from workers.sampling.params import SamplingParams


def test_temperature_zero_is_greedy_with_the_warpers_off_once_for_every_edge():
    """Guards `_normalize`'s greedy branch: without it a temperature-0 request with a top_p would
    sample (TGI's rule alone) on the worker while OpenAI's edge meant greedy."""
    p = GenerationParameters.create(temperature=0.0, top_p=0.5, top_k=7, min_p=0.2)
    assert (p.do_sample, p.temperature, p.top_p, p.top_k, p.min_p) == (False, 1.0, 1.0, 0, 0.0)
    tiny = GenerationParameters.create(temperature=MIN_TEMPERATURE / 2, do_sample=True, top_k=3)
    assert tiny.greedy and tiny.top_k == 0
    assert GenerationParameters.create(top_k=5).do_sample  # TGI: any warper samples
    assert GenerationParameters.create(temperature=0.7).do_sample
    assert GenerationParameters.create().greedy
    # the same request through OpenAI's edge and TGI's gives the same contract value
    openai = CompletionRequest(prompt="x", temperature=0, top_p=0.5).sampling(8)
    tgi = GenerateRequest(inputs="x", parameters={"max_new_tokens": 8, "top_p": 0.5}).to_worker().parameters
    assert openai.greedy and not tgi.greedy  # TGI has no temperature 0: a top_p samples there
    sampled = CompletionRequest(prompt="x", temperature=0.5, top_k=3, max_tokens=8).sampling(8)
    tgi = GenerateRequest(inputs="x", parameters={"max_new_tokens": 8, "temperature": 0.5, "top_k": 3})
    mine = tgi.to_worker().parameters
    assert (sampled.do_sample, sampled.temperature, sampled.top_k) == (mine.do_sample, mine.temperature, mine.top_k)


@pytest.mark.parametrize(("fields", "needle"), [
    ({"max_new_tokens": 0}, "0 is accepted with `decoder_input_details`"),
    ({"do_sample": True, "temperature": 0}, "`temperature` must be > 0 when `do_sample` is true"),
    ({"ignore_eos": True, "grammar": {"type": "regex", "value": "a+"}}, "`ignore_eos` cannot go with a grammar"),
    ({"min_tokens": 9, "max_new_tokens": 4}, "`min_tokens` must be an integer in [0, 4]"),
    ({"prompt_top_n_tokens": 21}, "`prompt_top_n_tokens` must be an integer in [0, 20]"),
])
def test_the_contract_names_what_it_refuses(fields, needle):
    with pytest.raises(ValueError) as e:
        GenerationParameters.create(**fields)
    assert needle in str(e.value)


def test_the_worker_parses_what_the_router_sends_into_the_same_value():
    """The wire carries what the edge set; the worker's contract fills in the same defaults,
    so both processes hold one value, and the sampler takes it under the same names."""
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.4, seed=9,
                                 stop=["\n"], logit_bias={"7": 2.0}, logprobs=True, top_logprobs=2, max_tokens=5)
    sent = WorkerRequest(inputs="hi", parameters=chat.sampling(chat.max_new_tokens, top_n_tokens=chat.top_n))
    received = WorkerRequest.model_validate_json(wire_bytes(sent))
    assert received == sent
    s = SamplingParams.from_request(received.parameters)
    assert (s.temperature, s.seed, s.stop, s.logit_bias, s.top_n_tokens) == (0.4, 9, ("\n",), ((7, 2.0),), 2)
    assert s.include_stop_str_in_output is False  # OpenAI cuts the stop string


def test_a_prompt_scored_twice_over_is_one_field():
    """Guards the pop in `_OpenAISampling.sampling`: vLLM's `prompt_logprobs` and the route's own
    prompt scoring (`echo` with `logprobs`) both ask for `decoder_input_details`."""
    req = CompletionRequest(prompt="x", max_tokens=1, echo=True, logprobs=1, prompt_logprobs=1)
    p = req.sampling(1, top_n_tokens=1, decoder_input_details=True)
    assert p.decoder_input_details and p.prompt_top_n_tokens == 1


def test_only_the_contracts_shapes_cross_to_a_worker():
    """Guards `wire_bytes`' type check: a plain dict never reaches a worker."""
    with pytest.raises(TypeError, match="not a request the contract declares"):
        wire_bytes({"inputs": "x"})  # type: ignore[arg-type]
    from workers.serving.routes import embed, generate, tokens

    bodies = [p.field_info.annotation for module in (generate, embed, tokens) for route in module.router.routes
              for p in route.dependant.body_params]
    assert bodies and all(b in WireRequest.__args__ for b in bodies), bodies


def test_routing_reads_the_typed_fields_and_a_resumed_stream_is_one_request():
    router = Router()
    asked = WorkerRequest(input_ids=(1, 2, 3), parameters=GenerationParameters(max_new_tokens=10))
    resumed = asked.model_copy(update={"resume_ids": (5, 6)})
    facts = router.request(resumed, Constraints())
    assert (facts.ids, facts.new_tokens, facts.chars) == (5, 8, 0)  # the resumed tokens are prompt now
    assert router.request(TokenizeRequest(prompt="hello"), Constraints()).new_tokens == 0  # a count generates nothing
    assert fingerprint("/generate_stream", resumed) == fingerprint("/generate_stream", asked)
    assert fingerprint("/generate_stream", asked) != fingerprint("/generate", asked)
