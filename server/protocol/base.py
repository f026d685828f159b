"""What the public request shapes share: the edge model config, refusals and limits.

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
