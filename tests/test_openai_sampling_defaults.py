"""OpenAI routes apply the model's generation_config sampling to fields a request leaves out."""

from __future__ import annotations

from server.protocol.openai.requests import ChatCompletionRequest, CompletionRequest
from workers.contract import GenerationParameters

DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 40}


def test_left_out_fields_take_the_models_defaults():
    """Guards `defaults.get(name, fallback) if value is None` in `_OpenAISampling.sampling`:
    without it a chat request with no temperature samples the raw distribution at 1.0."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = req.sampling(8, DEFAULTS)
    assert p.do_sample is True
    assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.9, 40)


def test_request_values_win_and_temperature_zero_is_greedy():
    req = CompletionRequest(prompt="x", temperature=0.3, top_p=0.5)
    p = req.sampling(8, DEFAULTS)
    assert (p.temperature, p.top_p, p.top_k) == (0.3, 0.5, 40)
    greedy = CompletionRequest(prompt="x", temperature=0).sampling(8, DEFAULTS)
    off = GenerationParameters()  # the contract's neutral values: what a worker is sent as absent
    assert greedy.do_sample is False and greedy.top_p == off.top_p and greedy.temperature == off.temperature


def test_without_model_defaults_openai_defaults_apply():
    p = CompletionRequest(prompt="x").sampling(8, {})
    off = GenerationParameters()
    assert p.do_sample is True and p.temperature == 1.0 and p.top_p == off.top_p and p.top_k == off.top_k
