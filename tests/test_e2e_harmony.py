"""gpt-oss's harmony output end to end: the real router and a real worker serving a tiny
gpt-oss checkpoint whose tokenizer has harmony's special tokens, spoken to with the `openai`
client.

The checkpoint is transformers' own tiny gpt-oss (tests/family_checkpoints.py) with the
embedded tokenizer extended by harmony's seven special tokens (the vocabulary grown to hold
them), `<|return|>` and `<|call|>` as its EOS tokens (as gpt-oss's generation_config lists
them), the harmony-style template of tests/test_harmony.py, and weights edited
(tests/forced_output.py) so that greedy decoding answers the plain question with analysis then
final and the weather question with a tool call whose recipient stands after the role, as
gpt-oss writes them. Harmony repeats `<|channel|>` and `<|message|>`, so the edit uses a
sliding window of the last few tokens (gpt-oss's first layer is a sliding one). The worker
streams each tag as a special token's text and leaves it out of `generated_text`; `<|call|>`
and `<|return|>` arrive as the finish token.
"""

from __future__ import annotations

import json

import openai
import pytest

from server.protocol.chat import load_chat_template
from server.protocol.harmony import CALL, RETURN, TAGS
from tests.family_checkpoints import make_family_checkpoint
from tests.forced_output import force_outputs, grow_vocab
from tests.router_harness import RouterProcess
from tests.test_harmony import FINAL, ROLE_CALL, TEMPLATE, WEATHER_TOOL

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Think, then answer."}]
ASK_TOOL = [{"role": "user", "content": "Weather in Paris?"}]
VOCAB = 4104  # the embedded tokenizer's 4096 and harmony's 7, rounded up to a multiple of 8
WINDOW = 6  # tokens the forced table looks back over (5 to 8 tell these outputs apart)


def _harmony_checkpoint(out):
    """The tiny gpt-oss checkpoint whose greedy answers to ASK and ASK_TOOL are FINAL and ROLE_CALL."""
    from tokenizers import AddedToken, Tokenizer

    make_family_checkpoint("gpt_oss", out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TAGS])
    tokenizer.save(str(out / "tokenizer.json"))
    grow_vocab(out, VOCAB)
    generation = json.loads((out / "generation_config.json").read_text())
    eos = [tokenizer.token_to_id(RETURN), tokenizer.token_to_id(CALL)]
    (out / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": eos}))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    template = load_chat_template(out)

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False).ids

    chains = [(ids(template.render(ASK)), ids(FINAL)), (ids(template.render(ASK_TOOL, tools=[WEATHER_TOOL])),
                                                        ids(ROLE_CALL))]
    force_outputs(out, chains, window=WINDOW)
    return out, [len(output) for _, output in chains]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    ckpt, generated = _harmony_checkpoint(tmp_path_factory.mktemp("gpt-oss-harmony"))
    router = RouterProcess(["--model", str(ckpt), "--dtype", "float32"], fake=False, ready_timeout=120)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield client, generated
    router.stop()
    assert not router.orphans


def _streamed(client, **kw):
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls or ()]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return reasoning, content, calls, finish, chunks[-1].usage


def test_analysis_and_final_come_back_as_reasoning_and_content_streamed_and_not(served):
    client, generated = served
    kw = dict(model="m", messages=ASK, max_tokens=32, temperature=0)
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content, message.tool_calls) == ("abc", "answer", None)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == generated[0]  # headers count
    reasoning, content, calls, finish, usage = _streamed(client, **kw)
    assert (reasoning, content, calls, finish) == ("abc", "answer", [], "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    cut = client.chat.completions.create(**{**kw, "max_tokens": 8})  # `<|channel|>analysis<|message|>abc`, cut
    assert (cut.choices[0].message.reasoning_content, cut.choices[0].message.content) == ("abc", None)
    assert cut.choices[0].finish_reason == "length"


def test_a_call_to_a_function_comes_back_as_tool_calls_streamed_and_not(served):
    client, generated = served
    kw = dict(model="m", messages=ASK_TOOL, tools=[WEATHER_TOOL], max_tokens=48, temperature=0)
    r = client.chat.completions.create(**kw)
    message, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls" and message.content is None and message.reasoning_content is None
    (call,) = message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_") and r.usage.completion_tokens == generated[1]
    reasoning, content, calls, finish, _ = _streamed(client, **kw)
    assert (reasoning, content, finish) == ("", "", "tool_calls")
    assert [c.function.name for c in calls if c.id] == ["get_weather"]
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments
    none = client.chat.completions.create(**kw, tool_choice="none")  # the same output, no call returned
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"


def test_a_bad_reasoning_effort_is_refused_and_a_good_one_reaches_the_prompt(served):
    client, _ = served
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=2, reasoning_effort="extreme")
    assert "`reasoning_effort`" in e.value.message and "Accepted: low, medium, high" in e.value.message
    low = client.chat.completions.create(model="m", messages=ASK, max_tokens=32, temperature=0, reasoning_effort="low")
    assert (low.choices[0].message.reasoning_content, low.choices[0].message.content) == ("abc", "answer")
