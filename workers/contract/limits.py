"""What a generation request may hold, as both processes check it: one definition per limit.

The router refuses a bad request at its edge (pydantic shapes: a 422 naming the field before
any worker is asked) and the worker checks the same values again when it builds its
`SamplingParams` (a worker started by hand, the router's own requests: the canary, a
migrated stream). Both read the numbers and the two shape checks below from here, so an
edge and a worker can never disagree on what is accepted. No torch, no pydantic.
"""

from __future__ import annotations

from workers.contract.json_schema import check_json_value, load_json_schema

DEFAULT_MAX_NEW_TOKENS = 100  # tokens generated when a request does not say (TGI's default)
MAX_SEED = 2**64 - 1  # a seed is any unsigned 64-bit integer (TGI's `u64`, torch.Generator's range)
MAX_STOP_SEQUENCES = 16  # `stop` strings per request (OpenAI allows 4; more are accepted here)
MAX_LOGPROBS = 20  # top alternatives per token (`top_logprobs`, `logprobs`, `top_n_tokens`), as vLLM
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI
MAX_LOGIT_BIAS_TOKENS = 1024  # tokens one `logit_bias` may list
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI

# `parameters.grammar.type`: TGI's three, `json_object` (any object; what OpenAI's
# `response_format` asks for) and `choice` (exactly one of a list of strings: vLLM's
# `guided_choice`).
GRAMMAR_TYPES = ("json", "regex", "json_schema", "json_object", "choice")
MAX_CHOICES = 1024  # strings one `choice` grammar may list

# The budget of one grammar compile on a worker (workers/sampling/grammar.py): wall-clock
# seconds, memory of the sandboxed compile, compiles at once, and the compiled grammars kept.
GRAMMAR_COMPILE_TIMEOUT_S = 5.0
GRAMMAR_COMPILE_MEMORY_MIB = 512
GRAMMAR_COMPILE_WORKERS = 2
GRAMMAR_CACHE_MIB = 256


def grammar_budget_error(timeout_s: float, memory_mib: int, workers: int, cache_mib: int) -> str | None:
    """Why a grammar compile budget cannot work (one message naming the flag and its value), or
    None: the worker's configuration and its `CompileBudget` check the same values with it."""
    if not timeout_s > 0:
        return f"`--grammar-compile-timeout {timeout_s}` must be > 0 seconds"
    for flag, value in (("grammar-compile-memory-mib", memory_mib), ("grammar-compile-workers", workers)):
        if value < 1:
            return f"`--{flag} {value}` must be at least 1"
    if cache_mib < 0:
        return f"`--grammar-cache-mib {cache_mib}` must be >= 0 (0 keeps none)"
    return None


def grammar_value(kind: str, value):
    """A request grammar's value, checked for its type: a non-empty pattern (`regex`), a schema
    as an object or JSON text (`json`, loaded), `{"name": ..., "schema": ...}` (`json_schema`,
    its schema loaded), nothing (`json_object`). `ValueError` names the field and what it takes;
    what the grammar engine cannot enforce is the worker's to say."""
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError("`grammar.value` must be a non-empty regular expression for type `regex`")
        return valid_unicode(value, "grammar.value")
    if kind == "choice":
        if (not isinstance(value, list) or not 1 <= len(value) <= MAX_CHOICES
                or not all(isinstance(v, str) and v for v in value)):
            raise ValueError(f"`grammar.value` must be a list of 1 to {MAX_CHOICES} non-empty strings for type "
                             "`choice`")
        return check_json_value(value, "`grammar.value`")
    if kind == "json":
        return load_json_schema(value, "`grammar.value`")
    if kind == "json_schema":
        if not isinstance(value, dict) or "schema" not in value:
            raise ValueError('`grammar.value` must be `{"name": ..., "schema": {...}}` for type `json_schema`')
        return {**value, "schema": load_json_schema(value["schema"], "`grammar.value.schema`")}
    if kind == "json_object":
        return None
    raise ValueError(f"Unknown grammar type `{kind}`. Accepted: {', '.join(GRAMMAR_TYPES)}")


def valid_unicode(text: str, field: str) -> str:
    """`text` itself when it is valid Unicode; `ValueError` naming `field` at a lone surrogate
    (`"\\ud800"` is valid JSON, but no tokenizer can encode it: a 422, never a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start : e.end].encode("unicode_escape").decode()
        raise ValueError(f"`{field}` is not valid Unicode: a lone surrogate `{bad}` at character {e.start}. "
                         "Accepted: text whose \\ud800-\\udfff escapes come in valid pairs") from None
    return text
