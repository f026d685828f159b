"""The Messages request (pydantic, HTTP edge only) and its translation into a chat request.

Accepted as Anthropic defines it, and what this server cannot do is refused by name (the fields
and refusals: docs/clients.md). Design: `chat_request` builds the `ChatCompletionRequest` fields,
so the chat route's checks and decisions (template, tools, grammar, reasoning) apply unchanged: a
user turn's `tool_result` blocks become `tool` messages (in order, before the turn's text), an
assistant turn's `tool_use` blocks its `tool_calls`, `thinking` blocks its reasoning, and
`redacted_thinking` is dropped (nothing readable, as Anthropic's own API drops it from the
prompt). Trade-off: Anthropic's shapes are only ever a chat request here, so an Anthropic
feature with no chat equivalent (server tools, documents) is refused rather than approximated.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from server.protocol.base import TOKENS_MAX, Edge, EdgeRequest, StopText
from workers.contract import MAX_STOP_SEQUENCES

MIN_THINKING_BUDGET = 1024  # Anthropic's least `budget_tokens`


class TextBlock(Edge):
    type: Literal["text"]
    text: str = Field(max_length=1_000_000)


class ToolUseBlock(Edge):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=200)
    name: str = Field(max_length=64)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(Edge):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=200)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(Edge):
    type: Literal["thinking"]
    thinking: str = Field(max_length=1_000_000)
    signature: str | None = None


class RedactedThinkingBlock(Edge):
    type: Literal["redacted_thinking"]
    data: str = ""


_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
_UNSUPPORTED = "unsupported"


class UnsupportedBlock(Edge):
    """A block of a kind this server cannot read: its validation is the named refusal (raised in
    a validator, so the client gets a 422 naming the kind; the discriminator itself must not raise)."""

    type: Any  # required: a block without a `type` is refused as missing it

    @field_validator("type", mode="before")
    @classmethod
    def _refuse(cls, kind):
        shown = kind if isinstance(kind, str) else json.dumps(kind, default=str)[:40]
        raise ValueError(f"`{shown}` blocks are not supported. Accepted: {', '.join(_BLOCKS)}")


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _BLOCKS else _UNSUPPORTED


Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[UnsupportedBlock, Tag(_UNSUPPORTED)],
    Discriminator(_block_kind),
]


class Message(Edge):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(Edge):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: Literal["custom"] | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _kind(cls, value):
        if value not in (None, "custom"):
            shown = value if isinstance(value, str) else json.dumps(value, default=str)[:40]
            raise ValueError(f"server tools (`{shown}`) are not supported. Accepted: custom tools (no `type`)")
        return value


class ToolChoice(Edge):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, max_length=64)
    disable_parallel_tool_use: bool = False


class Thinking(Edge):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1, le=TOKENS_MAX)


class OutputFormat(Edge):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Edge):
    """`output_config`: `format` is a JSON schema the text is constrained to (the chat route's
    `response_format`); `effort` reaches the template as `reasoning_effort` (low, medium, high:
    the levels a chat template knows; `xhigh` and `max` are refused by name)."""

    effort: Literal["low", "medium", "high"] | None = None
    format: OutputFormat | None = None


class CacheControl(Edge):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Metadata(Edge):
    user_id: str | None = Field(None, max_length=1000)


class MessagesBase(EdgeRequest):
    """What a message and its token count share (`/v1/messages/count_tokens` takes only these)."""

    model: str | None = Field(None, max_length=1000)
    messages: list[Message] = Field(min_length=1, max_length=10_000)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # a caching hint: the worker's prefix cache keeps every prompt's blocks anyway, so it is honoured
    cache_control: CacheControl | None = None

    @model_validator(mode="after")
    def _choice(self):
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise ValueError("`tool_choice.name` is required when `tool_choice.type` is `tool`")
        return self

    def system_text(self) -> str | None:
        if self.system is None:
            return None
        return self.system if isinstance(self.system, str) else "\n\n".join(b.text for b in self.system)


class MessagesRequest(MessagesBase):
    max_tokens: int = Field(ge=1, le=TOKENS_MAX)
    stop_sequences: list[StopText] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=1_000_000)
    metadata: Metadata | None = None
    stream: bool = False
    service_tier: Literal["auto"] | None = None
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _thinking(self):
        t = self.thinking
        if t is not None and t.type == "enabled":
            if t.budget_tokens is None or not MIN_THINKING_BUDGET <= t.budget_tokens < self.max_tokens:
                raise ValueError(f"`thinking.budget_tokens` must be >= {MIN_THINKING_BUDGET} and less than "
                                 f"`max_tokens` ({self.max_tokens}), got `{t.budget_tokens}`")
        return self


def _turns(message: Message) -> list[dict]:
    """One Anthropic message -> chat messages (tool results first, as their own `tool` turns)."""
    out: list[dict] = []
    text, reasoning, calls = [], [], []
    for block in message.blocks():
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
    if text or calls or reasoning or not out:
        turn: dict = {"role": message.role, "content": "".join(text) if text or not calls else None}
        if reasoning and message.role == "assistant":
            turn["reasoning_content"] = "\n".join(reasoning)
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def chat_request(req: MessagesBase) -> dict:
    """The `ChatCompletionRequest` fields for `req` (a count_tokens request: no sampling fields)."""
    system = req.system_text()
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [turn for m in req.messages for turn in _turns(m)]
    metadata = getattr(req, "metadata", None)
    fields: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": getattr(req, "max_tokens", None),
                              "temperature": getattr(req, "temperature", None), "top_p": getattr(req, "top_p", None),
                              "top_k": getattr(req, "top_k", None),
                              "stop": getattr(req, "stop_sequences", None) or None,
                              "user": metadata.user_id if metadata else None}
    if req.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    output = getattr(req, "output_config", None)
    if output is not None and output.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                            "schema": output.format.schema_}}
    if output is not None and output.effort is not None:
        fields["reasoning_effort"] = output.effort
    return {k: v for k, v in fields.items() if v is not None}
