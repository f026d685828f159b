"""Resuming a request whose first tokens were generated elsewhere.

Design: when a worker dies mid-stream the router sends the request to another worker with the
token ids the client already received (`resume_ids`). The sequence starts with them as its
output, so every count (positions, `generated_tokens`, `max_new_tokens`, repetition penalties)
sees them as the original did; the detokenizer replays them, a grammar consumes them and a
seeded generator skips the original's draws, so the answer goes on exactly where it stopped.
Trade-off: nothing but token ids crosses; the KV comes from the host KV tier where the first worker
put it (written through as blocks filled, and all of it before a shutdown ends the stream:
workers/kvtier/publish.py), and what the tier lacks is computed again (one prefill)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceT

from workers.sampling.grammar import advance
from workers.sampling.params import ParameterError, SamplingParams


def check_resume_ids(resume_ids: SequenceT[int], params: SamplingParams, vocab_size: int | None) -> list[int]:
    """The resumed tokens as a list, or `ParameterError` naming what is wrong with them."""
    resumed = list(resume_ids)
    if len(resumed) >= params.max_new_tokens:
        raise ParameterError(f"`resume_ids` holds {len(resumed)} tokens: `max_new_tokens` "
                             f"({params.max_new_tokens}) must leave at least one to generate")
    bad = [t for t in resumed if isinstance(t, bool) or not isinstance(t, int) or t < 0
           or (vocab_size is not None and t >= vocab_size)]
    if bad:
        limit = vocab_size if vocab_size is not None else "the vocabulary size"
        raise ParameterError(f"`resume_ids` holds `{bad[0]}`, not a token id. Accepted: integers in [0, {limit})")
    return resumed


def replay(seq, resumed: list[int]) -> None:
    """Make `seq` (new, not yet scheduled, its detokenizer and grammar matcher set) look as if
    it had generated `resumed` itself."""
    for token_id in resumed:
        seq.detok.add(token_id)  # its text reached the client already; this rebuilds the state
        if seq.grammar is not None:
            advance(seq.grammar, token_id)
    seq.output_ids.extend(resumed)
