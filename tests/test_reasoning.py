"""The reasoning parser (server/protocol/reasoning.py) and where the OpenAI layer uses it:
tags cut anywhere across token boundaries, prompts that open or close the block, thinking
turned off, streamed deltas against the whole answer, tool calls after the reasoning, the
request field `chat_template_kwargs`, the `--reasoning-parser` flag, and the route wiring
through an in-process router over stand-in workers."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from server.cli import build_parser
from server.config.settings import RouterSettings
from server.errors import UsageError
from server.protocol.chat import load_chat_template
from server.protocol.openai.choices import ChoiceSpec, ChoiceStream, chat_choice
from server.protocol.openai.requests import ChatCompletionRequest
from server.protocol.openai.tools import AUTO, ToolPlan
from server.protocol.reasoning import (
    ReasoningSplitter,
    add_reasoning,
    choose_parser,
    plan_reasoning,
    split_reasoning,
)
from tests.inprocess_router import inprocess_router

QWEN3 = choose_parser("qwen3", "", None)
OPENED = plan_reasoning(QWEN3, "<|im_start|>assistant\n<think>\n")  # the prompt opened the block
FREE = plan_reasoning(QWEN3, "<|im_start|>assistant\n")  # the output may open it itself

# (plan, output, (reasoning_content, content))
CASES = [
    (OPENED, "abc</think>answer", ("abc", "answer")),
    (OPENED, "\nI think.\n\n</think>\n\nParis.", ("I think.", "Paris.")),
    (OPENED, "<think>abc</think>x", ("abc", "x")),  # a repeated start tag is dropped
    (OPENED, "a<b </th>c</think>d</think>e", ("a<b </th>c", "d</think>e")),  # only the first end tag splits
    (OPENED, "</think>answer", (None, "answer")),  # empty reasoning: null
    (OPENED, "still thinking\n", ("still thinking", None)),  # cut inside the reasoning: no content
    (OPENED, "", (None, None)),
    (FREE, "<think>\nabc\n</think>\n\nanswer", ("abc", "answer")),
    (FREE, "  \n<think>x</think>y", ("x", "y")),
    (FREE, "Hello <think> and </think> here", (None, "Hello <think> and </think> here")),  # not at the start
    (FREE, "\n<thin", (None, "\n<thin")),  # a start tag that never completes is content, as written
    (FREE, "<think>éà 思考</think>答え", ("éà 思考", "答え")),
]


def _stream(plan, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(plan)
    parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize(("plan", "text", "expected"), CASES)
def test_every_split_of_the_output_gives_the_whole_answer(plan, text, expected):
    assert split_reasoning(plan, text) == expected
    want = tuple(v or "" for v in expected)
    assert _stream(plan, list(text)) == want  # one character per token
    for cut in range(len(text) + 1):
        assert _stream(plan, [text[:cut], text[cut:]]) == want, cut
    for a in range(len(text)):  # every three-piece split, the tags cut in every way
        for b in range(a, len(text)):
            assert _stream(plan, [text[:a], text[a:b], text[b:]]) == want, (a, b)


def test_only_a_possible_tag_or_a_newline_waits():
    s = ReasoningSplitter(OPENED)
    assert s.feed("\n\nab") == ("ab", "")  # leading newlines dropped, text out at once
    assert s.feed("c <") == ("c ", "")  # `<` may begin `</think>`
    assert s.feed("b") == ("<b", "")  # it did not
    assert s.feed("\n</th") == ("", "")
    assert s.feed("ink>\n") == ("", "")  # the newlines after the end tag are dropped too
    assert s.feed("\nAns") == ("", "Ans")
    assert s.feed("wer</think>") == ("", "wer</think>")  # content is never held
    assert s.finish() == ("", "") and s.entered
    free = ReasoningSplitter(FREE)
    assert free.feed(" <thi") == ("", "")  # may still open the block
    assert free.feed("s is it") == ("", " <this is it") and not free.entered


def test_the_prompt_thinking_off_or_a_grammar_decide_whether_anything_is_parsed():
    assert OPENED.opened and not FREE.opened
    assert plan_reasoning(QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None  # the template closed it
    assert plan_reasoning(QWEN3, "x<think>\n", {"enable_thinking": False}) is None
    # only false itself, as templates test
    assert plan_reasoning(QWEN3, "x<think>\n", {"enable_thinking": "false"}).opened
    assert plan_reasoning(QWEN3, "x<think>\n", constrained=True) is None  # response_format / forced tool call
    assert split_reasoning(None, "abc</think>answer") == (None, "abc</think>answer")


def test_the_parser_is_chosen_from_the_flag_the_template_and_the_family():
    think = "{{ '<think>\\n' }}"
    assert choose_parser("auto", think, None).syntax.start == "<think>"
    assert choose_parser("auto", "plain", "qwen3_moe").syntax is not None
    assert "smollm3" in choose_parser("auto", "plain", "smollm3").reason
    assert choose_parser("auto", "plain", "gemma3_text").syntax is None
    assert choose_parser("none", think, "qwen3").syntax is None
    assert choose_parser("qwen3", "plain", "llama").syntax is not None
    with pytest.raises(ValueError, match="`deepseek_r1`. Accepted: auto, qwen3, none"):
        choose_parser("deepseek_r1", "", None)


def test_the_family_comes_from_config_json_else_from_the_worker(tmp_path):
    reported = {"chat_template": "plain", "model_type": "qwen3"}
    assert load_chat_template(tmp_path, reported).model_type == "qwen3"  # a router without the model's files
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "smollm3"}))
    assert load_chat_template(tmp_path, reported).model_type == "smollm3"
    assert load_chat_template(tmp_path / "absent").model_type is None
    # a worker reports its family as `architecture` (workers/engine/describe.py): guards chat.py's
    # `else reported.architecture` fallback
    assert load_chat_template(tmp_path / "absent",
                              {"chat_template": "plain", "architecture": "qwen3"}).model_type == "qwen3"


def test_the_serve_flag_reaches_the_settings():
    parse = build_parser().parse_args
    assert RouterSettings.from_args(parse(["serve"])).reasoning_parser == "auto"
    assert RouterSettings.from_args(parse(["serve", "--reasoning-parser", "none"])).reasoning_parser == "none"
    with pytest.raises(UsageError, match="`--reasoning-parser r1` is not a parser. Accepted: auto, qwen3, none"):
        RouterSettings.from_args(parse(["serve", "--reasoning-parser", "r1"]))


def tok(text: str, special: bool = False) -> dict:
    return {"id": 7, "text": text, "logprob": -0.25, "special": special}


PIECES = ["\n", "ab", "c", "\n<", "/", "th", "ink", ">", "\n\n", "ans", "wer"]
DONE = {"finish_reason": "eos_token", "generated_tokens": len(PIECES) + 1, "input_length": 9}


def _deltas(spec: ChoiceSpec, pieces: list[str], details: dict) -> tuple[list[dict], ChoiceStream]:
    s = ChoiceStream(spec, chat=True)
    events = [{"token": tok(p)} for p in pieces] + [{"token": tok("<eos>", special=True), "details": details}]
    return [d for e in events for d in s.on_event(e)], s


def test_streamed_deltas_concatenate_to_the_whole_message_and_counts_are_unchanged():
    spec = ChoiceSpec(0, top=0, reasoning=OPENED)
    deltas, s = _deltas(spec, PIECES, DONE)
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    reasoning = "".join(d["delta"].get("reasoning_content") or "" for d in deltas)
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert not any("reasoning_content" in d["delta"] and "content" in d["delta"] for d in deltas)
    whole = chat_choice(spec, {"generated_text": "".join(PIECES), "details": {
        **DONE, "tokens": [tok(p) for p in PIECES] + [tok("<eos>", special=True)]}})
    assert (reasoning, content) == ("abc", "answer")
    assert (whole["message"]["reasoning_content"], whole["message"]["content"]) == ("abc", "answer")
    entries = [x for d in deltas if d["logprobs"] for x in d["logprobs"]["content"]]
    assert len(entries) == len(whole["logprobs"]["content"]) == len(PIECES) + 1  # every token keeps its entry
    assert deltas[-1]["finish_reason"] == "stop" and (s.prompt_tokens, s.completion_tokens) == (9, len(PIECES) + 1)


def test_reasoning_cut_by_the_length_limit_is_all_reasoning():
    spec = ChoiceSpec(0, reasoning=OPENED)
    deltas, _ = _deltas(spec, ["Let", " me", " see\n"], {"finish_reason": "length", "generated_tokens": 3})
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "Let me see"
    assert all(not d["delta"].get("content") for d in deltas) and deltas[-1]["finish_reason"] == "length"
    whole = chat_choice(spec, {"generated_text": "Let me see\n", "details": {"finish_reason": "length"}})
    assert whole["message"] == {"role": "assistant", "content": None, "reasoning_content": "Let me see"}


def test_without_a_plan_the_message_has_no_reasoning_field():
    whole = chat_choice(ChoiceSpec(0), {"generated_text": "abc</think>x", "details": {"finish_reason": "eos_token"}})
    assert whole["message"] == {"role": "assistant", "content": "abc</think>x"}


def test_tool_calls_are_parsed_from_the_answer_after_the_reasoning():
    plan = ToolPlan(AUTO, ({"name": "get_weather", "parameters": {"type": "object"}},))
    spec = ChoiceSpec(0, tools=plan, reasoning=FREE)
    text = ('<think>\nThe user wants weather.\n</think>\n\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    whole = chat_choice(spec, {"generated_text": text, "details": {"finish_reason": "eos_token"}})
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["reasoning_content"] == "The user wants weather."
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    deltas, _ = _deltas(spec, [text[i:i + 3] for i in range(0, len(text), 3)], {"finish_reason": "eos_token"})
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == "The user wants weather."
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or ()]
    assert [c["function"]["name"] for c in calls if c.get("id")] == ["get_weather"]  # then argument deltas
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert not any(d["delta"].get("content") for d in deltas)


def test_add_reasoning_aligns_with_the_requests_messages_behind_a_tool_system_message():
    messages = [{"role": "system", "content": "tools..."}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}]
    out = add_reasoning(messages, [None, "because"])
    assert out[2]["reasoning_content"] == "because" and "reasoning_content" not in out[0]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ([1, 2], "`chat_template_kwargs`: must be an object of template variables, got `[1, 2]`. Accepted: an object"),
        ("enable_thinking", 'got `"enable_thinking"`'),
        ({"messages": []}, "`messages` is set by the request itself, not here. Accepted: any other template variable"),
        ({"tools": []}, "`tools` is set by the request itself"),
        ({f"v{i}": i for i in range(65)}, "has 65 variables; at most 64"),
    ],
)
def test_chat_template_kwargs_must_be_an_object_of_other_variables(kwargs, needle):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs)
    assert needle.split("`: ", 1)[-1] in str(e.value)
    ok = ChatCompletionRequest(messages=[{"role": "assistant", "content": "a", "reasoning": "r"}],
                               chat_template_kwargs={"enable_thinking": False, "documents": [{"text": "d"}]})
    assert ok.chat_template_kwargs["enable_thinking"] is False and ok.messages[0].reasoning_text() == "r"


OPENING_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
                    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                    "{% else %}<think>\n{% endif %}")


@pytest.mark.slow
def test_the_route_splits_by_the_flag_and_the_template_keywords(tmp_path):
    """Stand-in workers answer ` t0 t1 t2`; the template opens the block, so with the parser the
    whole (unfinished) output is reasoning; `none` or `enable_thinking` false leave it content."""
    (tmp_path / "chat_template.jinja").write_text(OPENING_TEMPLATE)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with inprocess_router("sm_80", model_dir=tmp_path) as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": None, "reasoning_content": " t0 t1 t2"}
        off = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
        assert off.json()["choices"][0]["message"]["content"] == " t0 t1 t2"
        sse = client.post("/v1/chat/completions", json={**body, "stream": True}).text
        chunks = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks) == " t0 t1 t2"
        bad = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": "x"})
        assert bad.status_code == 422 and "`chat_template_kwargs`: must be an object" in bad.json()["error"]["message"]
    with inprocess_router("sm_80", model_dir=tmp_path, reasoning_parser="none") as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message == {"role": "assistant", "content": " t0 t1 t2"}
