"""Tool calls in the model's own format and reasoning, through all three chat shapes (chat
completions, Responses, Messages) with the real `openai` and `anthropic` clients against a
real router and worker.

Tiny Qwen3 checkpoints (tests/family_checkpoints.py) whose weights are edited into lookup
tables (tests/forced_output.py), so greedy decoding writes a fixed text and the server must
read it back as the model's template defines it, with no grammar (`tool_choice` auto):
- a Hermes-style template (Qwen2.5/Qwen3's: tools listed in `<tools>`, calls in
  `<tool_call>` JSON, results in `<tool_response>`), its tokenizer holding `<tool_call>` and
  `</tool_call>` as added tokens as Qwen's does, answering the weather question with a call
  (arguments first: the one key order a 4-token window tells apart; the parser takes either).
  The parser is chosen from the template (`--tool-call-parser auto`);
- a Llama 3.1-style template (the tools and its JSON instruction, `"parameters": dictionary of
  argument name`, in the user turn), answering with a bare JSON call (llama3_json); a Mistral
  template with `[TOOL_CALLS]NAME[ARGS]{...}` whose two tags are special tokens (mistral); a
  template showing pythonic calls, answering `[get_weather(city="Paris")]` (pythonic);
- the thinking template of tests/test_e2e_reasoning.py, answering with `abc</think>answer`:
  a `reasoning` item in Responses, a `thinking` block in Messages;
and gpt-oss's harmony checkpoint of tests/test_e2e_harmony.py through Responses and Messages.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from server.protocol.chat import load_chat_template
from tests.family_checkpoints import make_family_checkpoint
from tests.forced_output import force_outputs, grow_vocab
from tests.router_harness import RouterProcess
from tests.test_e2e_reasoning import ASK as THINK_ASK
from tests.test_e2e_reasoning import _bigram_checkpoint

pytestmark = pytest.mark.slow

HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- '</tools>\\nCall a function with <tool_call></tool_call> tags.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for call in message.tool_calls %}{{- '<tool_call>\\n{\"name\": \"' + call.function.name"
    " + '\", \"arguments\": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3.1's way: the tools and the JSON instruction in the user turn, a call written as bare JSON
LLAMA3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if tools and loop.last and message.role == 'user' %}"
    "{{- 'Given the following functions, respond with a JSON for a function call. Respond in the format "
    "{\"name\": function name, \"parameters\": dictionary of argument name and its value}.\\n\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n\\n' }}{%- endfor %}{%- endif %}"
    "{{- message.content + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_CALL = '{"parameters": {"city": "Paris"}, "name": "get_weather"}'
# Mistral's (v11 tokenizers: `[TOOL_CALLS]NAME[ARGS]{...}`, both tags special tokens, as in tekken)
MISTRAL_TEMPLATE = (
    "{%- if tools %}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{{- '[INST]' + message.content + '[/INST]' }}"
    "{%- elif message.tool_calls %}{%- for call in message.tool_calls %}{{- '[TOOL_CALLS]' + call.function.name"
    " + '[ARGS]' + (call.function.arguments | tojson) }}{%- endfor %}{{- '</s>' }}"
    "{%- else %}{{- message.content + '</s>' }}{%- endif %}{%- endfor %}"
)
MISTRAL_CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
# pythonic (Llama 3.2 / 4 style): the template shows a Python list of calls
PYTHONIC_TEMPLATE = (
    "{%- for message in messages %}{{- message.role + ': ' }}"
    "{%- if tools and loop.last and message.role == 'user' %}{{- 'Call functions as [func_name1(params_name1="
    "params_value1), func_name2(...)] from: ' + (tools | tojson) + '\\n' }}{%- endif %}"
    "{{- message.content + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)
PYTHONIC_CALL = '[get_weather(city="Paris")]'
FORMATS = {  # parser -> (template, the call, special tokens)
    "llama3_json": (LLAMA3_TEMPLATE, LLAMA3_CALL, ()),
    "mistral": (MISTRAL_TEMPLATE, MISTRAL_CALL, ("[TOOL_CALLS]", "[ARGS]")),
    "pythonic": (PYTHONIC_TEMPLATE, PYTHONIC_CALL, ()),
}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast.", "parameters": CITY}}
ASK_TOOL = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>'
VOCAB = 4104  # the embedded tokenizer's 4096 and the two tags, rounded up to a multiple of 8
EOS = 2


def _tool_checkpoint(out, template: str, call: str, added: tuple[str, ...] = (), special: tuple[str, ...] = ()):
    """The tiny Qwen3 checkpoint whose greedy answer to ASK_TOOL with WEATHER, in `template`, is
    `call`; `added` and `special` tokens join its tokenizer (special ones are left out of the
    answer's text unless the format reads them)."""
    from tokenizers import AddedToken, Tokenizer

    make_family_checkpoint("qwen3", out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    if added or special:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        tokenizer.save(str(out / "tokenizer.json"))
        grow_vocab(out, VOCAB)
    config = json.loads((out / "config.json").read_text())
    config["layer_types"][0] = "sliding_attention"  # the forced table's window layer (the others are zeroed)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(template)
    prompt = load_chat_template(out).render(ASK_TOOL, tools=[WEATHER])
    output = [*tokenizer.encode(call, add_special_tokens=False).ids, EOS]
    force_outputs(out, [(tokenizer.encode(prompt, add_special_tokens=False).ids, output)], window=4)
    return out, len(output)


def _serve(ckpt):
    return RouterProcess(["--model", str(ckpt), "--dtype", "float32"], fake=False, ready_timeout=120)


@pytest.fixture(scope="module")
def hermes_ckpt(tmp_path_factory):
    return _tool_checkpoint(tmp_path_factory.mktemp("qwen3-hermes"), HERMES_TEMPLATE, CALL,
                            ("<tool_call>", "</tool_call>"))


@pytest.fixture(scope="module")
def hermes(hermes_ckpt):
    ckpt, generated = hermes_ckpt
    router = _serve(ckpt)
    yield router, generated
    router.stop()
    assert not router.orphans


@pytest.fixture(scope="module", params=list(FORMATS))
def family(request, tmp_path_factory):
    template, call, special = FORMATS[request.param]
    ckpt, generated = _tool_checkpoint(tmp_path_factory.mktemp(request.param), template, call, special=special)
    router = _serve(ckpt)
    yield router, generated, request.param
    router.stop()
    assert not router.orphans


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    ckpt, generated = _bigram_checkpoint(tmp_path_factory.mktemp("qwen3-thinking"))
    router = _serve(ckpt)
    yield router, generated
    router.stop()
    assert not router.orphans


def _openai(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _anthropic(router) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=60)


GREEDY = {"temperature": 0}


def test_hermes_calls_come_back_as_chat_tool_calls_streamed_and_not(hermes):
    router, generated = hermes
    client = _openai(router)
    kw = dict(model="m", messages=ASK_TOOL, tools=[WEATHER], max_tokens=64, **GREEDY)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert r.usage.completion_tokens == generated
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert [t.function.name for t in calls if t.id] == ["get_weather"]
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"city": "Paris"}
    assert "".join(d.content or "" for d in deltas) == ""  # no tag, no JSON as text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    plain = client.chat.completions.create(**kw, tool_choice="none")  # the same text, read as no call
    assert plain.choices[0].message.tool_calls is None and "<tool_call>" in plain.choices[0].message.content
    cut = client.chat.completions.create(**{**kw, "max_tokens": 8})  # a call cut short is text, never a 500
    assert (cut.choices[0].finish_reason, cut.choices[0].message.tool_calls) == ("length", None)
    assert cut.choices[0].message.content.startswith("<tool_call>")


def test_hermes_calls_come_back_as_function_call_items_streamed_and_not(hermes):
    router, _ = hermes
    client = _openai(router)
    tool = {"type": "function", **WEATHER["function"]}
    kw = dict(model="m", input="Weather in Paris?", tools=[tool], max_output_tokens=64, **GREEDY)
    r = client.responses.create(**kw)
    (item,) = r.output
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(streamed) == {"city": "Paris"} == json.loads(final.output[0].arguments)
    assert final.output[0].name == "get_weather"


def test_hermes_calls_come_back_as_tool_use_blocks_streamed_and_not(hermes):
    router, _ = hermes
    client = _anthropic(router)
    tool = {"name": "get_weather", "description": "The forecast.", "input_schema": CITY}
    kw = dict(model="m", max_tokens=64, messages=ASK_TOOL, tools=[tool], extra_body=GREEDY)
    m = client.messages.create(**kw)
    (use,) = m.content
    assert (use.type, use.name, use.input, m.stop_reason) == ("tool_use", "get_weather", {"city": "Paris"},
                                                              "tool_use")
    with client.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == {"city": "Paris"} and final.content[0].input == {"city": "Paris"}
    assert [b.type for b in final.content] == ["tool_use"] and final.stop_reason == "tool_use"


def test_each_family_format_comes_back_as_tool_calls_in_all_three_shapes(family):
    """Llama 3 JSON, Mistral (its tags special tokens) and pythonic calls, the parser chosen
    from each template (`--tool-call-parser auto`), streamed and not."""
    router, generated, parser = family
    client = _openai(router)
    kw = dict(model="m", messages=ASK_TOOL, tools=[WEATHER], max_tokens=64, **GREEDY)
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert (r.choices[0].finish_reason, r.choices[0].message.content, r.usage.completion_tokens) == (
        "tool_calls", None, generated)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert [t.function.name for t in calls if t.id] == ["get_weather"] and not "".join(d.content or "" for d in deltas)
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"city": "Paris"}
    item = client.responses.create(model="m", input="Weather in Paris?", tools=[{"type": "function",
                                                                               **WEATHER["function"]}],
                                   max_output_tokens=64, **GREEDY).output[0]
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    m = _anthropic(router).messages.create(model="m", max_tokens=64, messages=ASK_TOOL, extra_body=GREEDY,
                                           tools=[{"name": "get_weather", "input_schema": CITY}])
    assert [(b.type, b.input) for b in m.content] == [("tool_use", {"city": "Paris"})]
    assert f"tool-call parser: {parser} (the chat template writes" in router.output()  # chosen, not defaulted


def test_thinking_is_a_reasoning_item_and_a_thinking_block(thinking):
    router, generated = thinking
    client = _openai(router)
    r = client.responses.create(model="m", input=THINK_ASK, max_output_tokens=32, **GREEDY)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "abc"
    assert (message.type, r.output_text, r.usage.output_tokens) == ("message", "answer", generated)
    with client.responses.stream(model="m", input=THINK_ASK, max_output_tokens=32, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "abc"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "answer"
    assert [o.type for o in final.output] == ["reasoning", "message"]
    # Messages: a thinking block, then the text
    claude = _anthropic(router)
    m = claude.messages.create(model="m", max_tokens=32, messages=THINK_ASK, extra_body=GREEDY)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "abc"), ("text", "answer")]
    with claude.messages.stream(model="m", max_tokens=32, messages=THINK_ASK, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thought = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                      and e.delta.type == "thinking_delta")
    assert thought == "abc" and [b.type for b in final.content] == ["thinking", "text"]
    off = claude.messages.create(model="m", max_tokens=32, messages=THINK_ASK, thinking={"type": "disabled"},
                                 extra_body=GREEDY)  # the template closes the block: nothing is reasoning
    assert [b.type for b in off.content] == ["text"]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    from tests.test_e2e_harmony import _harmony_checkpoint

    ckpt, _ = _harmony_checkpoint(tmp_path_factory.mktemp("gpt-oss-harmony"))
    router = _serve(ckpt)
    yield router
    router.stop()
    assert not router.orphans


def test_harmony_reads_into_responses_items_and_messages_blocks(harmony):
    """gpt-oss (tests/test_e2e_harmony.py's checkpoint): analysis then final, and a call to
    functions.get_weather, through Responses and Messages, streamed and not."""
    from tests.test_e2e_harmony import ASK as HARMONY_ASK
    from tests.test_e2e_harmony import ASK_TOOL as HARMONY_TOOL_ASK
    from tests.test_harmony import WEATHER_TOOL

    client, claude = _openai(harmony), _anthropic(harmony)
    r = client.responses.create(model="m", input=HARMONY_ASK, max_output_tokens=32, **GREEDY)
    assert [(o.type, getattr(o, "content", None) and o.content[0].text) for o in r.output] == [
        ("reasoning", "abc"), ("message", "answer")]
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    with client.responses.stream(model="m", input=HARMONY_TOOL_ASK, tools=[tool], max_output_tokens=48,
                                 **GREEDY) as stream:
        final = stream.get_final_response()
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    m = claude.messages.create(model="m", max_tokens=32, messages=HARMONY_ASK, extra_body=GREEDY)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "abc"), ("text", "answer")]
    with claude.messages.stream(model="m", max_tokens=48, messages=HARMONY_TOOL_ASK, extra_body=GREEDY,
                                tools=[{"name": "get_weather", "description": "Weather of a city",
                                        "input_schema": WEATHER_TOOL["function"]["parameters"]}]) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("tool_use", {"city": "Paris"})]
    assert final.stop_reason == "tool_use"


def test_tool_call_parser_none_returns_the_models_text_as_content(hermes_ckpt):
    """`--tool-call-parser none` overrides the template's choice: the same output, no call read."""
    router = RouterProcess(["--model", str(hermes_ckpt[0]), "--dtype", "float32", "--tool-call-parser", "none"],
                           fake=False, ready_timeout=120)
    try:
        r = _openai(router).chat.completions.create(model="m", messages=ASK_TOOL, tools=[WEATHER], max_tokens=64,
                                                    **GREEDY)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == CALL
        assert "tool-call parser: none (--tool-call-parser none)" in router.output()
    finally:
        router.stop()
