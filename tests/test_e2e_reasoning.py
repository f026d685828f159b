"""Reasoning output end to end: the real router and a real worker serving a tiny Qwen3
checkpoint, spoken to with the `openai` client.

The checkpoint is transformers' own tiny Qwen3 (tests/family_checkpoints.py) with a chat
template that ends the generation prompt with `<think>\\n`, as Qwen3-2507 Thinking and Qwen3.5
templates do, and weights edited into a bigram table (tests/forced_output.py) so that greedy
decoding writes `abc</think>answer` and stops. A constraint could not force this text: the
chat API takes no regular expression, and a grammar turns reasoning parsing off
(server/protocol/reasoning.py). `</think>` arrives in five tokens (`<`, `/`, `th`, `ink`, `>`),
so the streamed case splits the tag across token boundaries.
"""

from __future__ import annotations

import openai
import pytest

from server.protocol.chat import load_chat_template
from tests.family_checkpoints import make_family_checkpoint
from tests.forced_output import force_outputs
from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow

TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
OUTPUT = "abc</think>answer"
ASK = [{"role": "user", "content": "Think, then answer."}]
EOS = 2  # the embedded tokenizer's `<|eos|>`, the checkpoint's eos_token_id


def _bigram_checkpoint(out):
    """The tiny Qwen3 checkpoint whose greedy output after any prompt ending in a newline is OUTPUT."""
    from tokenizers import Tokenizer

    make_family_checkpoint("qwen3", out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    prompt = tokenizer.encode(load_chat_template(out).render(ASK), add_special_tokens=False).ids
    output = [*tokenizer.encode(OUTPUT, add_special_tokens=False).ids, EOS]
    force_outputs(out, [(prompt, output)])  # a bigram table: every token of the output is distinct
    return out, len(output)


def _prompt_tokens(ckpt, **kwargs) -> int:
    from tokenizers import Tokenizer

    prompt = load_chat_template(ckpt).render(ASK, **kwargs)
    return len(Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(prompt, add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _bigram_checkpoint(tmp_path_factory.mktemp("qwen3-thinking"))


@pytest.fixture(scope="module")
def served(ckpt):
    router = RouterProcess(["--model", str(ckpt[0]), "--dtype", "float32"], fake=False, ready_timeout=120)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield client, ckpt[1]
    router.stop()
    assert not router.orphans


def _streamed(client, **kw):
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning, content, chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def test_thinking_comes_back_as_reasoning_content_streamed_and_not(served):
    client, generated = served
    kw = dict(model="m", messages=ASK, max_tokens=32, temperature=0)
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == ("abc", "answer")
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == generated  # reasoning counts
    reasoning, content, usage, finish = _streamed(client, **kw)
    assert (reasoning, content, finish) == ("abc", "answer", "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)


def test_thinking_off_through_chat_template_kwargs_parses_nothing(served, ckpt):
    client, _ = served
    kw = dict(model="m", messages=ASK, max_tokens=32, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = client.chat.completions.create(**kw)
    assert (r.choices[0].message.content, getattr(r.choices[0].message, "reasoning_content", None)) == (OUTPUT, None)
    assert _streamed(client, **kw)[:2] == ("", OUTPUT)
    thinking = client.chat.completions.create(model="m", messages=ASK, max_tokens=32, temperature=0)
    # the keyword reached the template: it closed the block in the prompt (`<think>\n\n</think>\n\n`)
    more = _prompt_tokens(ckpt[0], enable_thinking=False) - _prompt_tokens(ckpt[0])
    assert more > 0 and r.usage.prompt_tokens == thinking.usage.prompt_tokens + more


def test_earlier_reasoning_reaches_the_template_and_bad_kwargs_are_refused(served):
    client, _ = served
    turns = [*ASK, {"role": "assistant", "content": "answer"}, {"role": "user", "content": "Again."}]
    plain = client.chat.completions.create(model="m", messages=turns, max_tokens=4, temperature=0)
    turns[1] = {**turns[1], "reasoning_content": "abc"}
    with_reasoning = client.chat.completions.create(model="m", messages=turns, max_tokens=4, temperature=0)
    assert with_reasoning.usage.prompt_tokens > plain.usage.prompt_tokens  # `<think>\nabc\n</think>` rendered
    for bad, needle in (([1], "`chat_template_kwargs`: must be an object"), ({"messages": []}, "`messages` is set")):
        with pytest.raises(openai.UnprocessableEntityError) as e:
            client.chat.completions.create(model="m", messages=ASK, max_tokens=4,
                                           extra_body={"chat_template_kwargs": bad})
        assert needle in e.value.message and "Accepted" in e.value.message
