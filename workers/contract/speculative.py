"""`--speculative` and `--num-speculative-tokens`: the names, the default and what each resolves to.

Design: one declaration both processes read (the router validates the flags, the worker's
configuration carries them). `auto` resolves per worker (workers/engine/speculate.py
`speculator_for`: suffix-tree drafts with k chosen per step where greedy output stays exact,
else off with the reason); `ngram` and `suffix` name the drafts' source. `mtp` is a name the interface
reserves; this build refuses it naming what it accepts, rather than silently serving without
speculation. Trade-off: a refusal at start instead of a fallback, so
a deployment that asked for a method knows it is not getting it.
"""

from __future__ import annotations

SPECULATIVE_MODES = ("auto", "off", "ngram", "suffix")
SPECULATIVE_RESERVED = {
    "mtp": "the checkpoint's MTP head is not loaded in this build",
}
DEFAULT_SPECULATIVE = "auto"
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
MAX_NUM_SPECULATIVE_TOKENS = 16


def speculative_error(mode: str, num_tokens: int | None) -> str | None:
    """Why `--speculative mode` with `--num-speculative-tokens num_tokens` cannot run, or None."""
    accepted = ", ".join(SPECULATIVE_MODES)
    if mode in SPECULATIVE_RESERVED:
        return f"`--speculative {mode}` is not available: {SPECULATIVE_RESERVED[mode]}. Accepted: {accepted}"
    if mode not in SPECULATIVE_MODES:
        return f"`--speculative {mode}` is not a method. Accepted: {accepted}"
    if num_tokens is not None and not 1 <= num_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
        return (f"`--num-speculative-tokens {num_tokens}` is out of range. "
                f"Accepted: 1..{MAX_NUM_SPECULATIVE_TOKENS}")
    return None
