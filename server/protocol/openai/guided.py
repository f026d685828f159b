"""vLLM's structured-output fields on the OpenAI routes, honoured as vLLM honours them.

vLLM's clients constrain the output with `structured_outputs` (vLLM 0.10.2 on: `json`, `regex`,
`choice` or `json_object`) and, before it, with the top-level `guided_json`, `guided_regex` and
`guided_choice` (what outlines, older vLLM clients and many scripts still send). Each becomes the
worker's `grammar`, compiled under the same budget as `response_format`; at most one constraint
per request, as vLLM refuses more than one, and a `structured_outputs` key or a dropped vLLM
field hetserve does not implement is refused by name. Trade-off: `guided_choice` is matched as
exact text (vLLM's behaviour), so a choice that only a special token spells cannot be produced
and ends the request with a 422, never with output outside the list.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, model_validator

from server.protocol.base import Edge, json_schema_value
from workers.contract import valid_unicode
from workers.contract.limits import MAX_CHOICES

ChoiceList = list[str]


class StructuredOutputs(Edge):
    """vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `json_object`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    json_: Any = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: ChoiceList | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    json_object: bool | None = None


class GuidedDecoding(Edge):
    """The structured-output fields; `guided_parameters` gives the worker's `grammar` (`json`,
    `regex` or `choice`: the output exactly one of the strings). A `structured_outputs` key
    hetserve does not implement (`grammar`, `structural_tag`, `whitespace_pattern`, ...) is a 422
    naming it; fields vLLM dropped (`guided_grammar`, `guided_decoding_backend`) are not declared
    here, so the edge refuses them as it refuses every unknown field."""

    guided_json: Any = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: ChoiceList | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    structured_outputs: StructuredOutputs | None = None

    @model_validator(mode="after")
    def _one_constraint(self):
        given = self._constraints()
        if len(given) > 1:
            raise ValueError(f"{' and '.join(f'`{name}`' for name, _ in given)} both constrain the output. Accepted: "
                             "one structured-output constraint per request")
        for name, (kind, value) in given:
            if kind == "json":
                json_schema_value(value, name)
            elif kind == "regex":
                valid_unicode(value, name)
            elif kind == "choice":
                if not all(value):
                    raise ValueError(f"`{name}` holds an empty string. Accepted: non-empty strings")
                for text in value:
                    valid_unicode(text, name)
        response_format = getattr(self, "response_format", None)
        tool_choice = getattr(self, "tool_choice", None)
        forced = tool_choice is not None and tool_choice not in ("none", "auto")
        if given and ((response_format is not None and response_format.type != "text") or forced):
            other = "`response_format`" if not forced else "a forced `tool_choice`"
            raise ValueError(f"`{given[0][0]}` and {other} both constrain the output. Accepted: one of them")
        return self

    def _constraints(self) -> list[tuple[str, tuple[str, Any]]]:
        out = []
        if self.guided_json is not None:
            out.append(("guided_json", ("json", self.guided_json)))
        if self.guided_regex is not None:
            out.append(("guided_regex", ("regex", self.guided_regex)))
        if self.guided_choice is not None:
            out.append(("guided_choice", ("choice", self.guided_choice)))
        so = self.structured_outputs
        if so is not None:
            for key, kind, value in (("json", "json", so.json_), ("regex", "regex", so.regex),
                                     ("choice", "choice", so.choice)):
                if value is not None:
                    out.append((f"structured_outputs.{key}", (kind, value)))
            if so.json_object:
                out.append(("structured_outputs.json_object", ("json_object", None)))
        return out

    def guided_grammar(self) -> dict | None:
        """The worker `grammar` these fields ask for (None: no constraint)."""
        given = self._constraints()
        if not given:
            return None
        name, (kind, value) = given[0]
        if kind == "json":
            return {"type": "json", "value": json_schema_value(value, name)}
        if kind == "json_object":
            return {"type": "json_object"}
        return {"type": kind, "value": value}

    def sampling(self, max_tokens: int | None, defaults: dict | None = None, **more):
        """The contract's parameters of the request, with the grammar these fields ask for (they
        exclude any other constraint: `_one_constraint`)."""
        if more.get("grammar") is None:
            more["grammar"] = self.guided_grammar()
        return super().sampling(max_tokens, defaults, **more)
