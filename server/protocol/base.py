"""What the public request shapes share: the edge model config, refusals and limits.

A request's root (`EdgeRequest`) keeps the fields it does not declare, and `unknown_fields`
names them, so the HTTP edge answers a field hetserve does not implement with a 400 naming it
(or a warning header, `--lenient-params`), never by silently ignoring it; objects inside a
request (messages, tools) ignore unknown keys, as clients echo back what the server sent
(an assistant message's `refusal`, `annotations`).

The limits themselves are the contract's (workers/contract/limits.py), the same numbers and
shape checks the workers apply, so the edge refuses exactly what a worker would, only sooner.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from workers.contract import load_json_schema

TOKENS_MAX = 1_000_000  # `max_new_tokens` / `max_tokens` at most (the model's context bounds it first)

StopText = Annotated[str, Field(min_length=1, max_length=1000)]


class Edge(BaseModel):
    # strict: `"5"`, `true` and `2.0` are not integers, `"true"` is not a boolean (as the OpenAI API)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class EdgeRequest(Edge):
    """A request body (or its `parameters` object): the fields it does not declare are kept, so
    the route refuses them by name (`unknown_fields`) instead of ignoring what a client asked for."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The names of the fields a request sent that it does not declare (null values ask for
    nothing and are not counted), its `EdgeRequest` fields' own included (`parameters.x`)."""
    names = [f"{prefix}{k}" for k, v in (model.model_extra or {}).items() if v is not None]
    for name in type(model).model_fields:
        value = getattr(model, name, None)
        if isinstance(value, EdgeRequest):
            names += unknown_fields(value, f"{prefix}{name}.")
    return names


def refuse(model: BaseModel, allowed: dict[str, tuple]) -> None:
    """422 for fields set to something this server cannot do (names field and accepted values)."""
    for name, ok_values in allowed.items():
        value = getattr(model, name)
        if value not in ok_values:
            shown = ", ".join("null" if v is None else str(v).lower() for v in ok_values)
            raise ValueError(f"`{name}` = `{value}` is not supported. Accepted: {shown}")


def json_schema_value(value: Any, field: str) -> dict | bool:
    """A JSON schema given as an object (or as JSON text, as TGI clients may): well-formedness
    only; the worker's grammar engine says what it cannot enforce."""
    return load_json_schema(value, f"`{field}`")
