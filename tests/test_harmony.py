"""gpt-oss's harmony format (server/protocol/harmony.py) and where the OpenAI layer uses it:
every split of a stream against the whole answer, analysis + final, tool calls (the recipient
after the channel or after the role), a length cut, output with no header, the prompt's open
header, special tokens that arrive as token events (the finish token `<|call|>` included),
the parser's automatic choice, earlier turns' reasoning and tool calls rendered back through a
harmony-style template by ours and transformers' renderer, and `reasoning_effort` from the
request to the template (an in-process router over stand-in workers)."""

from __future__ import annotations

import json
import shutil

import pytest
from pydantic import ValidationError

from server.cli import build_parser
from server.config.settings import RouterSettings
from server.protocol.chat import load_chat_template
from server.protocol.harmony import (
    TAGS,
    HarmonyAnswer,
    HarmonyPlan,
    HarmonySplitter,
    gather,
    output_text,
    plan_harmony,
    split_harmony,
)
from server.protocol.openai.choices import ChoiceSpec, ChoiceStream, chat_choice
from server.protocol.openai.requests import ChatCompletionRequest
from server.protocol.openai.tools import AUTO, NONE, ToolPlan, template_messages
from server.protocol.reasoning import add_reasoning, choose_parser, plan_reasoning
from tests.inprocess_router import inprocess_router
from workers.contract import DEFAULT_MODEL_DIR

GEN = HarmonyPlan()  # gpt-oss's generation prompt ends with `<|start|>assistant`
ANALYSIS = plan_harmony("<|start|>user<|message|>q<|end|><|start|>assistant<|channel|>analysis<|message|>")
FINAL = "<|channel|>analysis<|message|>abc<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>"
CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
ROLE_CALL = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
WEATHER = (("get_weather", '{"city": "Paris"}'),)

# (plan, output, (reasoning_content, content, tool calls))
CASES = [
    (GEN, FINAL, ("abc", "answer", ())),
    (GEN, CALL, ("Need the weather.", None, WEATHER)),
    (GEN, ROLE_CALL, (None, None, WEATHER)),  # the recipient after the role, as gpt-oss's template renders calls
    (GEN, "<|channel|>analysis<|message|>Let me th", ("Let me th", None, ())),  # cut by the length limit
    (GEN, '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"ci',
     (None, None, (("get_weather", '{"ci'),))),
    (GEN, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", ("a", None, ())),  # header cut
    (GEN, "Hello, <b>world</b> to=x", (None, "Hello, <b>world</b> to=x", ())),  # no header at all: plain content
    (GEN, "t", (None, "t", ())),
    (GEN, "", (None, None, ())),
    (GEN, "<|channel|>final<|message|>x<|return|><|start|>assistant<|channel|>final<|message|>more", (None, "x", ())),
    (GEN, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
          "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"  # a preamble is content
          "<|start|>assistant<|channel|>final<|message|>c<|return|>", ("a\nb", "Checking.\nc", ())),
    (GEN, "<|channel|>analysis to=python<|message|>print(1)<|call|>", ("print(1)", None, ())),  # a built-in tool
    (GEN, "<|channel|>commentary to=functions.a<|message|>{}<|end|><|start|>assistant<|channel|>commentary "
          'to=functions.b<|message|>{"x": 1}<|call|>', (None, None, (("a", "{}"), ("b", '{"x": 1}')))),
    (GEN, "<|channel|>analysis<|message|>x<|end|><|start|>functions.get_weather to=assistant<|channel|>commentary"
          "<|message|>{}<|end|><|start|>assistant<|channel|>final<|message|>y<|return|>", ("x", "y", ())),
    (GEN, "<|channel|>final<|message|>a<|message|>b<|constrain|>c<|end|>", (None, "abc", ())),  # stray tags dropped
    (GEN, "<|channel|>analysis<|message|>a<|channel|>final<|message|>b<|return|>", ("a", "b", ())),  # no <|end|>
    (GEN, "<|channel|>final<|message|>1 <|< 2 <|en", (None, "1 <|< 2 <|en", ())),  # tag-like text is text
    (GEN, "<|channel|>final<|message|>éà 思考<|return|>", (None, "éà 思考", ())),
    (ANALYSIS, "abc<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>", ("abc", "answer", ())),
    (HarmonyPlan(""), FINAL, ("abc", "answer", ())),  # a prompt without harmony (the parser forced)
]


def _stream(plan: HarmonyPlan, pieces: list[str]) -> HarmonyAnswer:
    splitter = HarmonySplitter(plan)
    return gather([p for piece in pieces for p in splitter.feed(piece)] + splitter.finish())


@pytest.mark.parametrize(("plan", "text", "expected"), CASES)
def test_every_split_of_the_output_gives_the_whole_answer(plan, text, expected):
    want = HarmonyAnswer(*expected)
    assert split_harmony(plan, text) == want
    assert not any(t in f for t in TAGS for f in (want.reasoning or "", want.content or ""))
    assert _stream(plan, list(text)) == want  # one character per token
    for a in range(len(text) + 1):  # every two- and three-piece split, the tags cut in every way
        assert _stream(plan, [text[:a], text[a:]]) == want, a
        for b in range(a, len(text) + 1):
            assert _stream(plan, [text[:a], text[a:b], text[b:]]) == want, (a, b)


def test_only_a_header_or_a_possible_tag_waits():
    s = HarmonySplitter(GEN)
    assert s.feed("<|channel|>analysis") == []  # a header gives nothing until its <|message|>
    parts = s.feed("<|message|>ab<|e")  # `<|e` may begin `<|end|>`
    assert [(p.kind, p.text) for p in parts] == [("reasoning", "ab")]
    assert [(p.kind, p.text) for p in s.feed("x")] == [("reasoning", "<|ex")]  # it did not
    assert s.feed("<|end|><|start|>assistant to=functions.f<|channel|>commentary json") == []
    parts = s.feed('<|message|>{"a"')
    assert [(p.kind, p.text, p.call) for p in parts] == [("tool_call", "f", 0), ("arguments", '{"a"', 0)]
    parts = s.feed(": 1}<|call|>after")
    assert [(p.kind, p.text) for p in parts] == [("arguments", ": 1}")] and s.calls == 1
    assert s.feed("more") == [] and s.finish() == []  # nothing after `<|call|>`
    plain = HarmonySplitter(GEN)
    assert plain.feed(" t") == [] and [p.text for p in plain.feed("he")] == [" the"]  # ` t` may begin ` to=`


def test_the_prompt_sets_where_the_output_starts_and_a_grammar_turns_parsing_off():
    prompt = "<|start|>system<|message|>Reasoning: low<|end|><|start|>user<|message|>hi<|end|><|start|>assistant"
    assert plan_harmony(prompt) == HarmonyPlan("assistant")
    assert plan_harmony(prompt, constrained=True) is None  # response_format / forced tool call: JSON only
    assert plan_harmony("no harmony here") == HarmonyPlan("")
    harmony = choose_parser("harmony", "", None)
    thinking_off = plan_reasoning(harmony, prompt, {"enable_thinking": False})
    assert thinking_off == HarmonyPlan("assistant")  # gpt-oss always writes its analysis
    assert plan_reasoning(harmony, prompt, constrained=True) is None


def test_the_parser_is_chosen_for_gpt_oss_and_harmony_templates():
    assert choose_parser("auto", "plain", "gpt_oss").syntax.name == "harmony"
    assert "gpt_oss" in choose_parser("auto", "plain", "gpt_oss").reason
    template = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"
    assert choose_parser("auto", template, None).syntax.name == "harmony"
    assert choose_parser("auto", "{{ '<think>' }}", "gpt_oss").syntax.name == "harmony"  # the family wins
    assert choose_parser("qwen3", "plain", "gpt_oss").syntax.name == "qwen3"  # a flag wins over the family
    assert choose_parser("harmony", "plain", "llama").syntax.name == "harmony"
    assert choose_parser("none", "plain", "gpt_oss").syntax is None
    with pytest.raises(ValueError, match="`r1`. Accepted: auto, qwen3, none, harmony"):
        choose_parser("r1", "", None)
    parse = build_parser().parse_args
    assert RouterSettings.from_args(parse(["serve", "--reasoning-parser", "harmony"])).reasoning_parser == "harmony"


# --- the OpenAI layer: token events in, choices out -------------------------------------------
TOOLS = ToolPlan(AUTO, ({"name": "get_weather", "parameters": {"type": "object"}},))


def _tokens(text: str) -> list[dict]:
    """Worker token entries of `text`: each tag a special token, the text between cut in threes."""
    out, rest = [], text
    while rest:
        tag = next((t for t in TAGS if rest.startswith(t)), None)
        cut = min((i for i in (rest.find(t, 1) for t in TAGS) if i > 0), default=len(rest))
        piece = tag or rest[: min(3, cut)]
        out.append({"id": 7, "text": piece, "logprob": -0.5, "special": tag is not None})
        rest = rest[len(piece):]
    return out


def _run(spec: ChoiceSpec, tokens: list[dict], finish: str = "eos_token") -> tuple[list[dict], dict]:
    """The stream's deltas and the whole choice of the same worker answer."""
    details = {"finish_reason": finish, "generated_tokens": len(tokens), "input_length": 9}
    events = [{"token": t} for t in tokens[:-1]] + [{"token": tokens[-1], "details": details}]
    s = ChoiceStream(spec, chat=True)
    deltas = [d for e in events for d in s.on_event(e)]
    generated = "".join(t["text"] for t in tokens if not t["special"])  # special tokens are not in the text
    return deltas, chat_choice(spec, {"generated_text": generated, "details": {**details, "tokens": tokens}})


def _joined(deltas: list[dict], field: str) -> str:
    return "".join(d["delta"].get(field) or "" for d in deltas)


def test_streamed_deltas_concatenate_to_the_whole_message_and_every_token_keeps_its_logprob():
    spec = ChoiceSpec(0, top=0, reasoning=GEN)
    tokens = _tokens(FINAL)
    deltas, whole = _run(spec, tokens)
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    assert (_joined(deltas, "reasoning_content"), _joined(deltas, "content")) == ("abc", "answer")
    assert whole["message"] == {"role": "assistant", "content": "answer", "reasoning_content": "abc"}
    entries = [x for d in deltas if d["logprobs"] for x in d["logprobs"]["content"]]
    assert len(entries) == len(whole["logprobs"]["content"]) == len(tokens)  # headers' tokens included
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "stop"


@pytest.mark.parametrize("text", [CALL, ROLE_CALL])
def test_a_call_ending_in_the_call_token_is_a_tool_call_streamed_and_not(text):
    """`<|call|>` is gpt-oss's EOS: it arrives as the finish event's special token."""
    deltas, whole = _run(ChoiceSpec(0, tools=TOOLS, reasoning=GEN), _tokens(text))
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or ()]
    assert [c["function"].get("name") for c in calls if "id" in c] == ["get_weather"]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert {c["index"] for c in calls} == {0} and calls[0]["id"].startswith("call_")
    assert deltas[-1]["finish_reason"] == whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    assert (call["function"], call["type"]) == ({"name": "get_weather", "arguments": '{"city": "Paris"}'}, "function")
    assert whole["message"]["content"] is None and not _joined(deltas, "content")
    assert whole["message"]["reasoning_content"] == (_joined(deltas, "reasoning_content") or None)


def test_the_finish_token_need_not_be_a_tag_and_a_length_cut_is_length():
    tokens = _tokens(CALL)[:-1] + [{"id": 2, "text": "<|eos|>", "logprob": -0.1, "special": True}]
    deltas, whole = _run(ChoiceSpec(0, tools=TOOLS, reasoning=GEN), tokens)
    assert whole["finish_reason"] == deltas[-1]["finish_reason"] == "tool_calls"  # the call was made
    assert "<|eos|>" not in json.dumps(whole) + json.dumps(deltas)  # other special tokens stay out
    cut = _tokens(CALL)[:-3]
    deltas, whole = _run(ChoiceSpec(0, tools=TOOLS, reasoning=GEN), cut, finish="length")
    assert whole["finish_reason"] == deltas[-1]["finish_reason"] == "length"
    had = "".join(t["text"] for t in cut[[t["text"] for t in cut].index("<|message|>", 10) + 1:])
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == had == '{"city": "Pa'  # what it had


def test_two_calls_are_two_tool_calls_with_their_own_arguments():
    """Guards `HarmonySplitter._emit`'s `!= ARGUMENTS`: messages of one kind are joined by a
    newline, but a second call's arguments are its own JSON, not a continuation."""
    text = ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}<|end|>'
            '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Rome"}<|call|>')
    deltas, whole = _run(ChoiceSpec(0, tools=TOOLS, reasoning=GEN), _tokens(text))
    args = [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert args == [{"city": "Oslo"}, {"city": "Rome"}] and whole["finish_reason"] == "tool_calls"
    streamed = {}
    for c in (c for d in deltas for c in d["delta"].get("tool_calls") or ()):
        streamed[c["index"]] = streamed.get(c["index"], "") + c["function"]["arguments"]
    assert streamed == {0: '{"city": "Oslo"}', 1: '{"city": "Rome"}'}


@pytest.mark.parametrize("tools", [ToolPlan(NONE), ToolPlan(NONE, TOOLS.functions)])
def test_without_auto_tools_a_call_is_not_returned(tools):
    deltas, whole = _run(ChoiceSpec(0, tools=tools, reasoning=GEN), _tokens(CALL))
    assert "tool_calls" not in whole["message"] and not any("tool_calls" in d["delta"] for d in deltas)
    assert whole["finish_reason"] == "stop" and whole["message"]["reasoning_content"] == "Need the weather."
    assert whole["message"]["content"] is None and "functions" not in json.dumps(deltas)


def test_output_text_keeps_only_harmonys_special_tokens():
    tokens = [{"text": "<|channel|>", "special": True}, {"text": "x", "special": False},
              {"text": "<|eos|>", "special": True}]
    assert output_text(tokens, "unused") == "<|channel|>x"
    assert output_text([], "fallback") == output_text(None, "fallback") == "fallback"


# --- earlier turns through a harmony-style template ------------------------------------------
TEMPLATE = """\
{{- '<|start|>system<|message|>Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') }}
{{- '<|end|>' }}
{%- if messages[0].role in ['system', 'developer'] %}
  {%- set instructions, turns = messages[0].content, messages[1:] %}
{%- else %}
  {%- set instructions, turns = '', messages %}
{%- endif %}
{%- if instructions or tools %}
  {{- '<|start|>developer<|message|>' }}
  {%- if instructions %}{{- '# Instructions\\n\\n' + instructions + '\\n\\n' }}{%- endif %}
  {%- if tools %}
    {{- '# Tools\\n\\nnamespace functions {\\n' }}
    {%- for tool in tools %}
      {{- '// ' + tool.function.description + '\\ntype ' + tool.function.name + ' = (_: ' }}
      {{- tool.function.parameters | tojson + ') => any;\\n' }}
    {%- endfor %}
    {{- '} // namespace functions' }}
  {%- endif %}
  {{- '<|end|>' }}
{%- endif %}
{%- set last = namespace(name=none) %}
{%- for message in turns %}
  {%- if message.role == 'assistant' and 'tool_calls' in message %}
    {%- if 'thinking' in message %}
      {{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}
    {%- endif %}
    {%- set call = message.tool_calls[0].function %}
    {{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' }}
    {{- call.arguments | tojson + '<|call|>' }}
    {%- set last.name = call.name %}
  {%- elif message.role == 'assistant' %}
    {{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}
  {%- elif message.role == 'tool' %}
    {{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' }}
    {{- message.content | tojson + '<|end|>' }}
  {%- else %}
    {{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
ROLE_CALL_TURN = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather'
                  '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>')


NEEDS_TOKENIZER = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file(),
                                     reason="the embedded tokenizer is not built")


def _model_dir(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    return tmp_path


def _render_both(tmp_path, req: ChatCompletionRequest) -> tuple[str, str]:
    """The router's rendering of `req` (template_messages, add_reasoning, its keywords) and
    transformers' of the same dicts."""
    from transformers import AutoTokenizer

    messages = add_reasoning(template_messages(req, native_tools=True), [m.reasoning_text() for m in req.messages])
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()] or None
    ours = load_chat_template(_model_dir(tmp_path)).render(messages, tools=tools, **req.template_kwargs())
    theirs = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR).apply_chat_template(
        messages, chat_template=TEMPLATE, tools=tools, tokenize=False, add_generation_prompt=True,
        **req.template_kwargs())
    return ours, theirs


@NEEDS_TOKENIZER
def test_a_parsed_tool_call_turn_renders_back_as_the_model_wrote_it(tmp_path):
    """The answer to ROLE_CALL_TURN, sent back as the client got it, renders (ours and
    transformers' alike) to exactly the text the model wrote, after `<|start|>assistant`."""
    ask = {"role": "user", "content": "Weather in Paris?"}
    answer = chat_choice(ChoiceSpec(0, tools=TOOLS, reasoning=GEN), {"generated_text": "", "details": {
        "finish_reason": "eos_token", "tokens": _tokens(ROLE_CALL_TURN)}})["message"]
    req = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."}, ask, answer,
        {"role": "tool", "content": "21 C", "tool_call_id": answer["tool_calls"][0]["id"]}],
        tools=[WEATHER_TOOL], reasoning_effort="high")
    ours, theirs = _render_both(tmp_path, req)
    assert ours == theirs
    assert "<|start|>assistant" + ROLE_CALL_TURN + "<|start|>functions.get_weather to=assistant" in ours
    assert ours.startswith("<|start|>system<|message|>Reasoning: high<|end|>") and ours.endswith("<|start|>assistant")
    assert '"21 C"' in ours and "# Instructions\n\nBe brief." in ours


@NEEDS_TOKENIZER
def test_a_final_turn_renders_back_without_its_reasoning(tmp_path):
    answer = chat_choice(ChoiceSpec(0, reasoning=GEN), {"generated_text": "", "details": {
        "finish_reason": "eos_token", "tokens": _tokens(FINAL)}})["message"]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}, answer,
                                          {"role": "user", "content": "Again"}])
    ours, theirs = _render_both(tmp_path, req)
    assert ours == theirs and "Reasoning: medium" in ours  # no effort asked: the template's default
    assert "<|start|>assistant<|channel|>final<|message|>answer<|end|><|start|>user" in ours and "abc" not in ours


# --- reasoning_effort ---------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "needle"), [
    ("extreme", "`extreme` is not a reasoning effort. Accepted: low, medium, high, or null"),
    (2, "`2` is not a reasoning effort. Accepted: low, medium, high"),
    ("LOW", "`LOW` is not a reasoning effort"),
])
def test_reasoning_effort_takes_low_medium_or_high(value, needle):
    ask = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(messages=ask, reasoning_effort=value)
    assert needle in str(e.value) and "reasoning_effort" in str(e.value)
    req = ChatCompletionRequest(messages=ask, reasoning_effort="low", chat_template_kwargs={"x": 1})
    assert req.template_kwargs() == {"x": 1, "reasoning_effort": "low"}
    assert ChatCompletionRequest(messages=ask).template_kwargs() == {}
    with pytest.raises(ValidationError, match="`reasoning_effort` = `low` and `chat_template_kwargs.reasoning_effort` "
                                              "= `high` disagree"):
        ChatCompletionRequest(messages=ask, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})


EFFORT_TEMPLATE = ("{% for m in messages %}{{ m.content }} {% endfor %}"
                   "{% if reasoning_effort is defined and reasoning_effort == 'high' %}think long and hard{% endif %}")


@pytest.mark.slow
def test_reasoning_effort_reaches_the_template_through_the_route(tmp_path):
    """Stand-in workers count the prompt's words as its tokens: `high` adds four."""
    (tmp_path / "chat_template.jinja").write_text(EFFORT_TEMPLATE)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with inprocess_router("sm_80", model_dir=tmp_path) as client:
        def prompt_tokens(**extra):
            r = client.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        high = prompt_tokens(reasoning_effort="high")
        assert high == prompt_tokens(reasoning_effort="low") + 4 == prompt_tokens() + 4
        bad = client.post("/v1/chat/completions", json={**body, "reasoning_effort": "max"})
        message = bad.json()["error"]["message"]
        assert bad.status_code == 422 and "reasoning_effort" in message and "Accepted: low, medium, high" in message
