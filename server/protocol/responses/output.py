"""Responses output: a chat choice -> output items and the `response` object (pure functions).

A chat choice's message becomes, in this order, a `reasoning` item (its `reasoning_content`,
as `reasoning_text` content; `summary` stays empty: the model writes no separate summary), a
`message` item (its content as one `output_text` part) and one `function_call` item per tool
call (`call_id` the chat tool call's id, which a client sends back with the call's output).
A choice cut by the length limit makes the response `incomplete` with `incomplete_details:
{"reason": "max_output_tokens"}`. Usage counts the reasoning among the output tokens, as
OpenAI does (`output_tokens_details.reasoning_tokens` is not measured separately: 0).
"""

from __future__ import annotations

import time
import uuid


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict:
    return {"type": "reasoning", "id": rid or item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str = "completed", mid: str | None = None) -> dict:
    return {"type": "message", "id": mid or item_id("msg"), "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", fid: str | None = None) -> dict:
    return {"type": "function_call", "id": fid or item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(choice: dict) -> list[dict]:
    """The output items of a whole chat choice."""
    message = choice.get("message") or {}
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"], status))
    if message.get("content"):
        items.append(message_item(message["content"], status))
    for call in message.get("tool_calls") or ():
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"], status))
    return items


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def response_object(rid: str, model: str, req, output: list[dict], status: str, use: dict | None,
                    created: int | None = None) -> dict:
    """The `response` object (`req`: the `ResponsesRequest`, whose settings it echoes)."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
        {"type": "text"}
    choice = req.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created or int(time.time()), "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt},
        "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
        "tools": [{**t.model_dump(exclude_none=True), "strict": t.strict} for t in req.tools or ()],
        "truncation": "disabled", "usage": use, "user": req.user, "metadata": req.metadata or {},
    }
