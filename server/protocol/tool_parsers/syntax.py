"""The tool-call formats, as data: where a call region opens, what it holds, how it closes.

One frozen `ToolSyntax` per format (`hermes`, `llama3_json`, `mistral`, `pythonic`, `generic`,
`required`; what each model writes: docs/clients.md), read by one machine (`splitter.py`),
rather than one parser class per family as vLLM has. Each region holds JSON call objects
`{"name": ..., "arguments" | "parameters": {...}}` (alone, in a `[...]` list or separated by
`;`), except Mistral's newer `NAME[ARGS]{...}` and the pythonic `[f(a=1), g()]`. Trade-off: the
formats differ only in these few facts, so a new family is a new value and every family streams
the same way, but a format that is more than these facts needs a new flag here. gpt-oss
(`openai`) writes harmony, read by server/protocol/harmony.py, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolSyntax:
    """One format: the facts a region's reader needs."""

    name: str
    # (marker that opens a call region anywhere in the text, what must close it or None)
    openings: tuple[tuple[str, str | None], ...] = ()
    bare: bool = False  # a `{` or `[` that starts the answer opens a region too (closed by the calls' end)
    separators: str = ","  # between call objects that are not in a list (`;` for Llama 3)
    named_args: bool = False  # also `NAME[ARGS]{...}` after an opening (Mistral's newer tokenizers)
    pythonic: bool = False  # the region is a Python list of calls, not JSON
    trailers: tuple[str, ...] = ()  # text dropped right after a region (`<|python_end|>`, `<|eom_id|>`)

    @property
    def markers(self) -> tuple[str, ...]:
        """Every tag of the format: a tokenizer may mark them special, and they must still be read."""
        tags = [t for pair in self.openings for t in pair if t] + list(self.trailers)
        if self.named_args:
            tags += ["[ARGS]", "[CALL_ID]"]
        return tuple(dict.fromkeys(tags))


HERMES = ToolSyntax("hermes", openings=(("<tool_call>", "</tool_call>"),))
LLAMA3_JSON = ToolSyntax("llama3_json", openings=(("<|python_tag|>", None),), bare=True, separators=";,",
                         trailers=("<|eom_id|>",))
MISTRAL = ToolSyntax("mistral", openings=(("[TOOL_CALLS]", None),), bare=True, named_args=True)
PYTHONIC = ToolSyntax("pythonic", openings=(("<|python_start|>", None),), bare=True, pythonic=True,
                      trailers=("<|python_end|>",))
# a model with no known format: hermes blocks, `[TOOL_CALLS]`, or a bare JSON call (or list) as the answer
GENERIC = ToolSyntax("generic", openings=(("<tool_call>", "</tool_call>"), ("[TOOL_CALLS]", None)), bare=True,
                     separators=";,")
REQUIRED = ToolSyntax("required", bare=True)  # the JSON list of calls `tool_choice: required`'s grammar makes

@dataclass(frozen=True)
class ScanCall:
    """A call read so far: its name, its arguments' text, whether that text is complete. A call
    still being written has its arguments as the end of `source` (the region's text) from `start`,
    so that a reading does not copy them each time the region grows."""

    name: str
    arguments: str
    complete: bool
    source: str | None = field(default=None, repr=False, compare=False)
    start: int = 0

    def arguments_from(self, k: int) -> str:
        """The arguments' text from its character `k` on."""
        return self.arguments[k:] if self.source is None else self.source[self.start + k:]


SYNTAXES = {s.name: s for s in (HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, GENERIC)}
