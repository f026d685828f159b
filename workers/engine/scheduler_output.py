"""What one scheduler step decided: the chunks that run, and what the step then did to each sequence.

`SchedulerOutput` is the scheduler's answer to "what runs next" (decodes first, then prompt
chunks, plus what was preempted and what the prefix cache saved); the runner turns it into
one forward, and the scheduler's `update_from_output` turns the sampled tokens into one
`TokenUpdate` per sampling chunk. Frozen values, kept apart from the policy that makes them
(workers/engine/scheduler.py), so tests can build them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One sequence's tokens in a step: a decode token, or a chunk of its prompt."""

    seq: Sequence
    start_pos: int  # = seq.num_computed when scheduled
    token_ids: list[int]
    block_table: list[int]  # the sequence's blocks, covering every position of the chunk
    samples: bool  # the chunk reaches the sequence's last token: a new token is sampled
    is_prefill: bool  # prompt (or recomputed) tokens rather than one decode token


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # decodes (oldest first), then prompt chunks
    num_prefill_tokens: int  # prompt tokens computed this step
    num_cached_tokens: int  # prompt tokens of newly admitted sequences found in the prefix cache
    num_queried_tokens: int  # tokens of newly admitted sequences looked up in the prefix cache
    preempted: tuple[Sequence, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def sampling(self) -> list[ScheduledChunk]:
        """The chunks that get one new token each, in chunk order (the rows of the logits)."""
        return [c for c in self.chunks if c.samples]


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """What one step did to one sequence: the token it got and whether it finished."""

    seq: Sequence
    token_id: int
    logprob: float
    finish_reason: str | None
