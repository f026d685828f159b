"""The Responses request (pydantic, HTTP edge only) and its translation into a chat request.

Accepted as OpenAI defines it, and what this server cannot do is refused by name (the fields and
refusals: docs/clients.md); `prompt_cache_key` is the routing session. Design: `chat_request`
builds the `ChatCompletionRequest` fields, so every check and decision of the chat route
(template, tools, grammar, reasoning) applies unchanged; `history` is what `previous_response_id`
brings: the earlier request's input items and its output items, which are input items
themselves. Trade-off: a response is only ever a chat request here, so a Responses feature with
no chat equivalent (built-in tools, background runs) is refused rather than approximated.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from server.protocol.base import TOKENS_MAX, Edge, EdgeRequest, refuse

MAX_ITEMS = 10_000
INCLUDABLE = ("reasoning.encrypted_content",)  # accepted: nothing to include (reasoning is not encrypted)


class TextPart(Edge):
    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str = Field(max_length=1_000_000)

    @field_validator("type", mode="before")
    @classmethod
    def _kind(cls, value):
        if value in ("input_image", "input_file", "input_audio", "refusal"):
            raise ValueError(f"`{value}` parts are not supported. Accepted: input_text, output_text")
        return value


class MessageItem(Edge):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(Edge):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=200)
    name: str = Field(max_length=64)
    arguments: str = Field("", max_length=1_000_000)


class FunctionCallOutputItem(Edge):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=200)
    output: str | list[TextPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(Edge):
    type: Literal["reasoning"]
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None
    encrypted_content: str | None = None

    @model_validator(mode="after")
    def _clear(self):
        refuse(self, {"encrypted_content": (None,)})  # this server never writes it
        return self

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(p.text for p in parts)


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")
    return kind if isinstance(kind, str) else "?"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(Edge):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _kind(cls, value):
        if value != "function":
            shown = value if isinstance(value, str) else json.dumps(value, default=str)[:40]
            raise ValueError(f"tools of type `{shown}` are not supported. Accepted: function")
        return value


class NamedFunction(Edge):
    type: Literal["function"]
    name: str = Field(max_length=64)


class TextFormat(Edge):
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=64)
    schema_: Any = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Edge):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the model's own length: the only one it can promise


class ReasoningConfig(Edge):
    effort: str | None = None  # checked by the chat request (`reasoning_effort`)
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted: the reasoning itself is returned


class ResponsesRequest(EdgeRequest):
    model: str | None = Field(None, max_length=1000)
    input: str | list[InputItem] = Field(max_length=MAX_ITEMS)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=TOKENS_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    previous_response_id: str | None = Field(None, max_length=200)
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=1000)
    # requests sharing a key share a cache (Codex sends its conversation's): the routing session
    prompt_cache_key: str | None = Field(None, max_length=1000)
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    background: bool | None = None
    service_tier: Literal["auto", "default"] | None = None

    model_config = {**EdgeRequest.model_config, "populate_by_name": True}

    @model_validator(mode="after")
    def _supported(self):
        refuse(self, {"background": (None, False)})
        for entry in self.include or ():
            if entry not in INCLUDABLE:
                raise ValueError(f"`include` entry `{entry[:60]}` is not supported. Accepted: {', '.join(INCLUDABLE)}")
        if not self.input:
            raise ValueError("`input` must not be empty")
        return self

    def items(self) -> list:
        """`input` as items (text is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


def chat_messages(items: list) -> list[dict]:
    """Input items -> chat messages: function calls join the assistant turn before them (or
    make one), a reasoning item becomes the next assistant turn's `reasoning_content`, a
    function call's output a `tool` message."""
    out: list[dict] = []
    reasoning: list[str] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text())
        elif isinstance(item, MessageItem):
            message = {"role": item.role, "content": item.text()}
            if item.role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "\n".join(reasoning), []
            out.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or (reasoning and not last.get("tool_calls")):
                last = {"role": "assistant", "content": None}
                out.append(last)
            if reasoning:
                last["reasoning_content"], reasoning = "\n".join(reasoning), []
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out


def chat_request(req: ResponsesRequest, history: list) -> dict:
    """The `ChatCompletionRequest` fields for `req`, after the `history` items."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + \
        chat_messages([*history, *req.items()])
    fields: dict[str, Any] = {"model": req.model, "messages": messages, "temperature": req.temperature,
                              "top_p": req.top_p, "max_tokens": req.max_output_tokens, "user": req.user,
                              "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, NamedFunction):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        fields["tool_choice"] = choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}}
    elif fmt is not None:
        fields["response_format"] = {"type": fmt.type}
    if req.reasoning is not None and req.reasoning.effort is not None:
        fields["reasoning_effort"] = req.reasoning.effort
    return {k: v for k, v in fields.items() if v is not None}
