"""Anthropic Messages and OpenAI Responses translated onto the chat request, and their stores
and stream writers, without a server (server/protocol/anthropic/, server/protocol/responses/)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from server.protocol.anthropic.messages import MessageEvents, message_object, stop_of
from server.protocol.anthropic.requests import MessagesRequest
from server.protocol.anthropic.requests import chat_request as messages_chat
from server.protocol.responses.store import (
    ENTRY_BYTES,
    MAX_CONVERSATION_BYTES,
    ResponseStore,
    Stored,
    check_conversation,
    items_json,
    join_items,
)

BASE = {"model": "m", "max_tokens": 64}


def _chat(**body) -> dict:
    return messages_chat(MessagesRequest.model_validate({**BASE, **body}))


def test_tool_use_and_tool_result_blocks_become_chat_tool_calls_and_tool_turns():
    chat = _chat(system=[{"type": "text", "text": "Be brief."}], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "look it up", "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "P"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom",
                                      "is_error": True}, {"type": "text", "text": "and?"}]}])
    system, user, assistant, tool, again = chat["messages"]
    assert system == {"role": "system", "content": "Be brief."} and user["content"] == "Weather?"
    assert assistant["reasoning_content"] == "look it up" and assistant["content"] is None
    assert assistant["tool_calls"] == [{"id": "toolu_1", "type": "function",
                                        "function": {"name": "w", "arguments": json.dumps({"c": "P"})}}]
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: boom"}  # before the turn's text
    assert again == {"role": "user", "content": "and?"}


@pytest.mark.parametrize(("choice", "want"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}),
])
def test_tool_choice_maps_onto_the_chat_tool_choice(choice, want):
    chat = _chat(messages=[{"role": "user", "content": "x"}], tools=[{"name": "w", "input_schema": {}}],
                 tool_choice={**choice, "disable_parallel_tool_use": True})
    assert chat["tool_choice"] == want and chat["parallel_tool_calls"] is False
    assert chat["tools"][0]["function"]["name"] == "w"


def test_thinking_output_config_and_cache_control_reach_the_chat_request():
    """Guards `output_config`, `cache_control` and thinking `adaptive` in
    server/protocol/anthropic/requests.py (the 2.x client's fields, 400s before)."""
    ask = [{"role": "user", "content": "x"}]
    chat = _chat(messages=ask, thinking={"type": "adaptive"}, cache_control={"type": "ephemeral", "ttl": "5m"},
                 output_config={"effort": "high", "format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert chat["chat_template_kwargs"] == {"enable_thinking": True} and chat["reasoning_effort"] == "high"
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output",
                                                                             "schema": {"type": "object"}}}
    assert _chat(messages=ask, thinking={"type": "disabled"})["chat_template_kwargs"] == {"enable_thinking": False}
    assert not MessagesRequest.model_validate({**BASE, "messages": ask, "cache_control": {"type": "ephemeral"}}
                                              ).model_extra


@pytest.mark.parametrize(("body", "needle"), [
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "`thinking.budget_tokens` must be >= 1024"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "`image` blocks"),
    ({"tools": [{"name": "s", "type": "web_search_20250305"}]}, "`web_search_20250305`"),
    ({"tool_choice": {"type": "tool"}}, "`tool_choice.name` is required"),
    ({"output_config": {"effort": "max"}}, "'low', 'medium' or 'high'"),
])
def test_what_messages_cannot_do_is_refused_by_name(body, needle):
    """Guards `UnsupportedBlock` in server/protocol/anthropic/requests.py: an image block made the
    block discriminator raise a bare ValueError (past validation: a 500) instead of a 422."""
    with pytest.raises(ValidationError) as e:
        MessagesRequest.model_validate({**BASE, "messages": [{"role": "user", "content": "x"}], **body})
    assert needle in str(e.value)


def test_stop_reasons_and_the_message_of_a_choice():
    assert stop_of("length", True, None, None) == ("max_tokens", None)
    assert stop_of("tool_calls", True, None, None) == ("tool_use", None)
    assert stop_of("stop", False, "END", ["END"]) == ("stop_sequence", "END")
    assert stop_of("stop", False, 2, ["END"]) == ("end_turn", None)  # a stop token id is no stop sequence
    choice = {"finish_reason": "tool_calls", "message": {"reasoning_content": "r", "content": "c", "tool_calls": [
        {"id": "call_9", "function": {"name": "w", "arguments": '{"a": 1}'}},
        {"id": "call_8", "function": {"name": "w", "arguments": "[1]"}}]}}
    m = message_object("msg_1", "m", choice, {}, None)
    assert [b["type"] for b in m["content"]] == ["thinking", "text", "tool_use", "text"]  # a non-object stays text
    assert m["content"][2] == {"type": "tool_use", "id": "toolu_9", "name": "w", "input": {"a": 1}}


def test_a_stream_starts_with_the_prompts_tokens_and_closes_each_block():
    writer = MessageEvents("msg_1", "m", None)
    start = writer.start(17)
    assert json.loads(start.split("data: ")[1].split("\n")[0])["message"]["usage"]["input_tokens"] == 17

    class Choice:
        prompt_tokens, completion_tokens = 17, 2

    frames = writer.deltas([{"delta": {"reasoning_content": "r"}}, {"delta": {"content": "a"}},
                            {"delta": {}, "finish_reason": "stop"}], Choice())
    kinds = [line[7:] for line in frames.splitlines() if line.startswith("event: ")]
    assert kinds == ["content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]


def _entry(items: list[dict], response: dict) -> Stored:
    return Stored(items_json(items), len(items), json.dumps(response).encode())


def test_the_response_store_keeps_the_latest_within_its_bounds():
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    for k in range(3):
        store.put(f"resp_{k}", _entry([{"type": "message", "k": k}], {"id": f"resp_{k}"}))
    assert store.get("resp_0") is None and json.loads(store.get("resp_2").response) == {"id": "resp_2"}
    assert len(store) == 2
    small = ResponseStore(max_responses=10, max_bytes=ENTRY_BYTES + 200)
    assert small.put("a", _entry([{"text": "x" * 150}], {}))
    small.put("b", _entry([{"text": "y" * 150}], {}))  # over the bytes: the older goes
    assert small.get("a") is None and small.get("b") is not None
    assert not small.put("c", _entry([{"text": "z" * 300}], {})) and small.get("c") is None  # larger than it all


def test_the_store_counts_the_bytes_it_holds():
    """Guards `Stored.size` (len of the stored bytes): the store counted characters of JSON
    while it held parsed items, 8 times as large."""
    store = ResponseStore()
    entries = [_entry([{"type": "reasoning", "summary": []}] * 1000, {"id": f"r{k}"}) for k in range(3)]
    for k, entry in enumerate(entries):
        store.put(f"r{k}", entry)
    held = sum(len(e.items) + len(e.response) for e in entries)
    assert store.bytes == held + 3 * ENTRY_BYTES
    assert "hetserve_router_responses_stored_bytes " + f"{store.bytes}.0" in store.metrics()


def test_a_conversation_is_joined_without_parsing_and_bounded_by_name():
    a, b = items_json([{"k": 1}]), items_json([{"k": 2}, {"k": 3}])
    assert json.loads(join_items(a, b)) == [{"k": 1}, {"k": 2}, {"k": 3}]
    assert join_items(b"[]", b) == b and join_items(a, b"[]") == a
    held = Stored(items_json([{"type": "reasoning"}] * 9_999), 9_999, b"{}")
    check_conversation(held, "resp_1", 1, 10)
    with pytest.raises(ValueError, match="`resp_1` holds 9999 items and `input` 2: more than the 10000 items"):
        check_conversation(held, "resp_1", 2, 10)
    with pytest.raises(ValueError, match=f"and `input` {MAX_CONVERSATION_BYTES}: more than the "
                                         f"{MAX_CONVERSATION_BYTES} bytes"):
        check_conversation(held, "resp_1", 1, MAX_CONVERSATION_BYTES)


def test_a_streamed_response_gives_each_parallel_call_its_own_item():
    from types import SimpleNamespace

    from server.protocol.responses.events import ResponseEvents
    from server.protocol.responses.requests import ResponsesRequest

    writer = ResponseEvents("resp_1", "m", ResponsesRequest.model_validate({"input": "x"}))
    writer.start()
    choice = SimpleNamespace(prompt_tokens=5, completion_tokens=9)
    deltas = [{"delta": {"reasoning_content": "think"}},
              {"delta": {"tool_calls": [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": ""}}]}},
              {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]}},
              {"delta": {"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}]}},
              {"delta": {}, "finish_reason": "tool_calls"}]
    frames = writer.deltas(deltas, choice)
    events = [json.loads(line[6:]) for line in frames.splitlines() if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in done] == [
        ("reasoning", None, None), ("function_call", "f", '{"x": 1}'), ("function_call", "g", "{}")]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == done
    assert events[-1]["response"]["usage"]["output_tokens"] == 9


def test_a_stream_whose_output_cannot_be_read_ends_with_an_error_event():
    """Guards the `except Exception` in `relay_choice` (server/edge/routes/_chat.py): an error
    while reading a choice's output (a RecursionError in the tool-call splitter did it) ended
    the stream with no finish and no error event."""
    import asyncio
    from types import SimpleNamespace

    from server.edge.routes._chat import UNREADABLE, relay_choice
    from server.protocol.responses.events import ResponseEvents
    from server.protocol.responses.requests import ResponsesRequest

    class Stream:
        worker, closed = None, False

        async def events(self):
            yield json.dumps({"token": {"id": 5, "text": "a", "special": False}})

        async def aclose(self):
            self.closed = True

    class Broken:
        done = False

        def on_event(self, event):
            raise RecursionError("maximum recursion depth exceeded")

    stream, writer = Stream(), ResponseEvents("resp_1", "m", ResponsesRequest.model_validate({"input": "x"}))
    writer.start()

    async def frames():
        ctx = SimpleNamespace(metrics=SimpleNamespace(stream_error=lambda worker: None))
        return [f async for f in relay_choice(stream, Broken(), writer, ctx)]

    (last,) = asyncio.run(frames())
    assert "event: error" in last and UNREADABLE in last and stream.closed
