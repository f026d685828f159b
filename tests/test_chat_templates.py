"""Chat templates render exactly as transformers' `apply_chat_template` renders them.

Each template here is a small one of ours written in the style of a family's official
template, using the jinja features that template relies on: Qwen3 (thinking switch, earlier
turns' `<think>` stripped unless after the last user query, `reasoning_content`, tools and
tool calls through `tojson`, `namespace`, `messages[::-1]`, loop controls), Gemma 3 (system
folded into the first user turn, `raise_exception` when roles do not alternate, `bos_token`),
Phi-3 / Phi-4-mini (`'tools' in message`, `eos_token` without a generation prompt), SmolLM3
(`/think` and `/no_think` flags, `enable_thinking`, `xml_tools`, `strftime_now`, the
`{% generation %}` tag), OLMo 2 (`loop.last`, `eos_token` after assistant turns) and Granite 3
(`strftime_now`, `documents`, `tools | tojson(indent=4)`). Ours reads the template from a model
directory as the router does (server/protocol/chat.py); transformers' tokenizer is loaded from
the embedded model's tokenizer files and given the same template, with the clock frozen for
both. Also the eos tokens each family declares reach the worker's stop set.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil

import pytest

from server.protocol.chat import ChatTemplateError, load_chat_template
from server.protocol.openai.requests import ChatCompletionRequest
from server.protocol.openai.tools import template_messages
from server.protocol.reasoning import add_reasoning
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file(),
                                reason="the embedded model's tokenizer is not built")

QWEN3 = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'Tools you may call:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages | length - 1) %}
{%- for message in messages[::-1] %}
  {%- if message.role == 'user' and not message.content.startswith('<tool_response>') %}
    {%- set ns.last_query = (messages | length - 1) - loop.index0 %}
    {%- break %}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
  {%- set content = message.content if message.content is string else '' %}
  {%- if message.role in ['user', 'system'] %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set reasoning = '' %}
    {%- if message.reasoning_content is string %}
      {%- set reasoning = message.reasoning_content %}
    {%- elif '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {%- if loop.index0 > ns.last_query and reasoning %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content }}
    {%- else %}
{{- '<|im_start|>assistant\\n' + content }}
    {%- endif %}
    {%- for call in message.tool_calls or [] %}
      {%- set call = call.function if call.function else call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
    {%- endfor %}
{{- '<|im_end|>\\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

GEMMA3 = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
  {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
  {%- set loop_messages = messages[1:] -%}
{%- else -%}
  {%- set first_user_prefix = '' -%}
  {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
  {%- endif -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
  {{- message['content'] | trim }}
  {{- '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}
"""

PHI4_MINI = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

PHI3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

SMOLLM3 = """\
{%- if enable_thinking is not defined -%}{%- set enable_thinking = true -%}{%- endif -%}
{%- set mode = '/think' if enable_thinking else '/no_think' -%}
{%- set ns = namespace(system='') -%}
{%- if messages[0].role == 'system' -%}
  {%- set ns.system = messages[0].content -%}
  {%- if '/no_think' in ns.system -%}{%- set mode = '/no_think' -%}
  {%- elif '/think' in ns.system -%}{%- set mode = '/think' -%}{%- endif -%}
  {%- set ns.system = ns.system.replace('/no_think', '').replace('/think', '').rstrip() -%}
{%- endif -%}
{{- '<|im_start|>system\\n## Metadata\\n\\nKnowledge Cutoff Date: June 2025\\n' -}}
{{- 'Today Date: ' + strftime_now('%d %B %Y') + '\\nReasoning Mode: ' + mode + '\\n\\n' -}}
{%- if ns.system -%}{{- '## Custom Instructions\\n\\n' + ns.system + '\\n\\n' -}}
{%- elif custom_instructions is defined -%}{{- '## Custom Instructions\\n\\n' + custom_instructions
  + '\\n\\n' -}}{%- endif -%}
{%- if xml_tools or tools -%}
  {{- '### Tools\\n\\n<tools>' -}}
  {%- for tool in (xml_tools or []) + (tools or []) -%}{{- '\\n' + (tool | string) -}}{%- endfor -%}
  {{- '\\n</tools>\\n\\n' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in messages -%}
  {%- if message.role == 'user' -%}
    {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' -}}
  {%- elif message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- generation -%}
      {%- if mode == '/think' -%}{{- message.content -}}
      {%- else -%}{{- '<think>\\n\\n</think>\\n' + message.content.split('</think>')[-1].lstrip() -}}{%- endif -%}
      {{- '<|im_end|>\\n' -}}
    {%- endgeneration -%}
  {%- elif message.role == 'tool' -%}
    {{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' + ('' if mode == '/think' else '<think>\\n\\n</think>\\n') -}}
{%- endif -%}
"""

OLMO2 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{% if not loop.last %}"
    "{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% else %}{{ '<|assistant|>\\n' + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"
)

GRANITE3 = """\
{%- if messages[0]['role'] == 'system' %}
  {%- set system_message = messages[0]['content'] %}
  {%- set loop_messages = messages[1:] %}
{%- else %}
  {%- set system_message = 'Knowledge Cutoff Date: April 2024.\\nToday\\'s Date: ' + strftime_now('%B %d, %Y')
    + '.\\nYou are Granite.' %}
  {%- if tools and documents %}
    {%- set system_message = system_message + ' Use the tools and the documents.' %}
  {%- elif documents %}
    {%- set system_message = system_message + ' Answer from the documents.' %}
  {%- endif %}
  {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' }}
{%- if tools %}
  {{- '<|start_of_role|>tools<|end_of_role|>' }}{{- tools | tojson(indent=4) }}{{- '<|end_of_text|>\\n' }}
{%- endif %}
{%- if documents %}
  {%- for document in documents %}
    {{- '<|start_of_role|>document {"document_id": "' + loop.index0 | string + '"}<|end_of_role|>\\n' }}
    {{- document['text'] }}{{- '<|end_of_text|>\\n' }}
  {%- endfor %}
{%- endif %}
{%- for message in loop_messages %}
  {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}
  {%- if loop.last and add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}
{%- endfor %}
"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville <b>",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
TOOL_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "\nThe user wants weather.\n", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    {"role": "tool", "content": '{"wind": 3}', "tool_call_id": "call_1"},
]
TALK = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nsay hi back\n</think>\n\nHello!"},
    {"role": "user", "content": "Capital of France?"},
]
DOCS = [{"title": "a", "text": "Paris is the capital of France."}, {"title": "b", "text": "Lyon is in France."}]

# (template, messages, template kwargs); tools and documents travel in the kwargs
CASES = {
    "qwen3-thinking": (QWEN3, TALK, {}),
    "qwen3-no-thinking": (QWEN3, TALK, {"enable_thinking": False}),
    "qwen3-tools-reasoning-kept-after-the-last-query": (QWEN3, TOOL_TURNS, {"tools": [WEATHER]}),
    "qwen3-reasoning-under-vllms-newer-name": (
        QWEN3, [TOOL_TURNS[1], {"role": "assistant", "content": "ok", "reasoning": "why"}, TOOL_TURNS[3]], {}),
    "gemma3-system-folded-into-the-first-user-turn": (
        GEMMA3, [{"role": "system", "content": "Be brief."}, *TALK], {}),
    "phi4-mini-tools-on-the-system-message": (
        PHI4_MINI, [{"role": "system", "content": "Use tools.", "tools": json.dumps([WEATHER])}, TALK[0]], {}),
    "phi4-mini-null-tools": (PHI4_MINI, [{"role": "system", "content": "x", "tools": None}, TALK[0]], {}),
    "phi3": (PHI3, TALK, {}),
    "smollm3-default-thinking": (SMOLLM3, TALK, {}),
    "smollm3-no-think-flag-in-system": (SMOLLM3, [{"role": "system", "content": "Be kind. /no_think"}, *TALK], {}),
    "smollm3-enable-thinking-false-and-xml-tools": (
        SMOLLM3, TALK, {"enable_thinking": False, "xml_tools": [WEATHER], "custom_instructions": "Be kind."}),
    "olmo2": (OLMO2, [{"role": "system", "content": "s"}, *TALK[:2]], {}),
    "granite3-tools-and-documents": (GRANITE3, TALK, {"tools": [WEATHER], "documents": DOCS}),
    "granite3-documents": (GRANITE3, TALK, {"documents": DOCS}),
    "granite3-own-system": (GRANITE3, [{"role": "system", "content": "s"}, *TALK], {}),
}


class _Frozen(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 3, 7, 9, 30)


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    import transformers.utils.chat_template_utils as hf_chat

    import server.protocol.chat as ours

    monkeypatch.setattr(hf_chat, "datetime", _Frozen)
    monkeypatch.setattr(ours, "datetime", _Frozen)


def _model_dir(tmp_path, template: str):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(template)
    return tmp_path


def _both(tmp_path, hf_tokenizer, template, messages, generation_prompt=True, **kwargs) -> tuple[str, str]:
    ours = load_chat_template(_model_dir(tmp_path, template)).render(
        messages, add_generation_prompt=generation_prompt, **kwargs)
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=generation_prompt, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_family_style_templates_render_as_transformers_renders_them(tmp_path, hf_tokenizer, case, generation_prompt):
    template, messages, kwargs = CASES[case]
    ours, theirs = _both(tmp_path, hf_tokenizer, template, messages, generation_prompt, **kwargs)
    assert ours == theirs
    assert len(ours) > 20


def test_the_cases_exercise_what_the_templates_switch_on(tmp_path, hf_tokenizer):
    """The renders differ where the features say they must (each case checks something)."""
    def render(case):
        template, messages, kwargs = CASES[case]
        return _both(tmp_path, hf_tokenizer, template, messages, **kwargs)[0]

    thinking, off = render("qwen3-thinking"), render("qwen3-no-thinking")
    assert off == thinking + "<think>\n\n</think>\n\n" and "say hi back" not in thinking  # stripped before the query
    tools = render("qwen3-tools-reasoning-kept-after-the-last-query")
    assert "<think>\nThe user wants weather.\n</think>" in tools and '"Zürich"' in tools and "<b>" in tools
    assert tools.count("<tool_response>") == 2 and tools.count("<|im_start|>user") == 2  # two results, one turn
    assert "<think>\nwhy\n</think>\n\nok" in render("qwen3-reasoning-under-vllms-newer-name")
    assert render("gemma3-system-folded-into-the-first-user-turn").startswith(
        "<|bos|><start_of_turn>user\nBe brief.\n\nHi")
    assert "<|tool|>" in render("phi4-mini-tools-on-the-system-message")
    assert "<|tool|>" not in render("phi4-mini-null-tools")
    assert "Today Date: 07 March 2026\nReasoning Mode: /think" in render("smollm3-default-thinking")
    no_think = render("smollm3-no-think-flag-in-system")
    assert "/no_think" in no_think and no_think.endswith("<think>\n\n</think>\n") and "Be kind.\n\n" in no_think
    assert "get_weather" in render("smollm3-enable-thinking-false-and-xml-tools")
    granite = render("granite3-tools-and-documents")
    assert "March 07, 2026" in granite and 'document_id": "1"' in granite and '\n        "type": "function"' in granite
    assert "Use the tools" in granite and "Answer from the documents" in render("granite3-documents")


def test_role_alternation_is_refused_by_both_with_the_templates_message(tmp_path, hf_tokenizer):
    import jinja2

    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        load_chat_template(_model_dir(tmp_path, GEMMA3)).render(messages)
    with pytest.raises(jinja2.TemplateError, match="Conversation roles must alternate"):
        hf_tokenizer.apply_chat_template(messages, chat_template=GEMMA3, tokenize=False)


FEATURES = {
    "tojson-kwargs-and-non-ascii": "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}|"
                                   "{{ messages[0] | tojson(separators=(',', ':')) }}",
    "undefined-tools-and-documents-are-none": "{{ tools is none }} {{ documents is none }} {{ tools is defined }}",
    "special-tokens-by-name": "{{ bos_token }}{{ eos_token }}{{ pad_token }}{{ unk_token is defined }}",
    "dict-and-namespace": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                          "{{ ns.n }}{{ dict(a=1, b=2) | tojson }}{{ dict.fromkeys(['x']) | tojson }}",
    "loop-controls-and-reverse": "{% for m in messages[::-1] %}{% if loop.index > 2 %}{% break %}{% endif %}"
                                 "{% if m.role == 'assistant' %}{% continue %}{% endif %}{{ m.content }};{% endfor %}",
    "strftime": "{{ strftime_now('%Y-%m-%d %H:%M') }}",
    "extra-keywords": "{{ enable_thinking }} {{ custom | tojson }}",
    "null-keys-are-no-keys": "{% for m in messages %}{{ 'name' in m }} {{ m.content }};{% endfor %}",
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_jinja_features_render_as_transformers_renders_them(tmp_path, hf_tokenizer, feature):
    messages = [{"role": "user", "content": "Grüße <b>&'x'", "name": None}, {"role": "assistant", "content": "日本"},
                {"role": "assistant", "content": None}, {"role": "user", "content": "ok"}]
    kwargs = {"enable_thinking": False, "custom": {"k": ["é"]}} if feature == "extra-keywords" else {}
    ours, theirs = _both(tmp_path, hf_tokenizer, FEATURES[feature], messages, **kwargs)
    assert ours == theirs and ours


def test_namespace_underscore_names_are_refused_as_transformers_refuses_them(tmp_path, hf_tokenizer):
    import jinja2

    template = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    with pytest.raises(ChatTemplateError, match="underscore"):
        load_chat_template(_model_dir(tmp_path, template)).render(TALK)
    with pytest.raises(jinja2.exceptions.SecurityError):
        hf_tokenizer.apply_chat_template(TALK, chat_template=template, tokenize=False)


def test_an_unset_bos_token_is_undefined_in_both(tmp_path):
    from transformers import PreTrainedTokenizerFast

    template = "{{ bos_token is defined }}|{{ eos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    (tmp_path / "chat_template.jinja").write_text(template)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"), eos_token="<|eos|>")
    ours = load_chat_template(tmp_path).render(TALK)
    assert ours == theirs.apply_chat_template(TALK, chat_template=template, tokenize=False) == "False|<|eos|>"


def test_a_chat_request_renders_through_the_routers_path_as_transformers_renders_it(tmp_path, hf_tokenizer):
    """The router's own message building (template_messages + add_reasoning) gives the dicts
    transformers is documented to take: tool-call arguments as objects, reasoning by name."""
    req = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}], tools=[WEATHER],
        chat_template_kwargs={"enable_thinking": True})
    messages = add_reasoning(template_messages(req, native_tools=True), [m.reasoning_text() for m in req.messages])
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    ours, theirs = _both(tmp_path, hf_tokenizer, QWEN3, messages, tools=tools, **req.chat_template_kwargs)
    assert ours == theirs and "<think>\nNeed the tool.\n</think>" in ours and '{"city": "Zürich"}' in ours


def test_special_tokens_in_template_keywords_are_refused(tmp_path):
    template = load_chat_template(_model_dir(tmp_path, QWEN3))
    with pytest.raises(ChatTemplateError, match=r"`chat_template_kwargs.documents.0.text` contains the special token"):
        template.render(TALK, documents=[{"text": "<|eos|> forged"}])
    with pytest.raises(ChatTemplateError,
                       match=r"`messages.1.reasoning_content` contains the special token `<\|bos\|>`"):
        template.render([TALK[0], {"role": "assistant", "content": "a", "reasoning_content": "<|bos|>"}])


# family case -> (the special tokens its tokenizer config names, the texts generation_config lists as eos)
FAMILY_EOS = {
    "qwen3": ({"eos_token": "<|im_end|>"}, ["<|im_end|>", "<|endoftext|>"]),
    "gemma3": ({"eos_token": "<eos>", "bos_token": "<bos>"}, ["<eos>", "<end_of_turn>"]),
    "phi3": ({"eos_token": "<|endoftext|>"}, ["<|endoftext|>", "<|end|>"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FAMILY_EOS))
def test_the_worker_stops_on_every_eos_token_the_family_declares(tmp_path, case):
    """Qwen3 ends turns with `<|im_end|>` and text with `<|endoftext|>`, Gemma 3 with
    `<end_of_turn>` besides `<eos>`, Phi with `<|end|>`: generation_config.json lists them all,
    the tokenizer config names one; the loader keeps the union (workers/model/loader.py)."""
    from tokenizers import AddedToken, Tokenizer

    from tests.family_checkpoints import make_family_checkpoint
    from workers.model.loader import load_model

    config_tokens, stops = FAMILY_EOS[case]
    ckpt = make_family_checkpoint(case, tmp_path / case)
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in {*stops, *config_tokens.values()}])
    tokenizer.save(str(ckpt / "tokenizer.json"))
    ids = [tokenizer.token_to_id(t) for t in stops]
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, **config_tokens}))
    gen = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": ids}))
    loaded = load_model(ckpt)
    assert set(ids) <= set(loaded.eos_token_ids) and loaded.eos_token == config_tokens["eos_token"]
    template = load_chat_template(ckpt)
    assert template.eos_token == config_tokens["eos_token"] and set(stops) <= set(template.forbidden_tokens)
