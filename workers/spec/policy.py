"""How many draft tokens a decode row carries this step (k, 0 included), with the reason.

Design: a verified draft costs a forward row per draft token whether it is accepted or not. On a
memory-bound device those rows are nearly free at small batches; on a compute-bound one (a CPU) or
in a full batch they are not. So k is the configured maximum while the step's batch is small and
the request's drafts pay, and 0 when the batch already has more than `max_rows` decode rows, when
the request's running acceptance rate has fallen below `min_acceptance` (rechecked with one probe
every `probe_every` tokens, so a request whose text turns repetitive recovers), when its grammar or
reported alternatives need the state of each token before the next is chosen, or when fewer than
two tokens remain to generate. Trade-off: fixed thresholds instead of the step costs measured per
device (the issue's full aim): simple and predictable, but a fast GPU would afford more rows.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_MAX_ROWS = 4  # decode rows above which a step speculates on none
MIN_ACCEPTANCE = 0.25  # below this running rate (after `WARMUP` draft tokens) a request stops drafting
WARMUP = 16
PROBE_EVERY = 16


@dataclass(frozen=True)
class SpecDecision:
    k: int
    reason: str


@dataclass(frozen=True)
class SpecPolicy:
    max_k: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    max_rows: int = DEFAULT_MAX_ROWS
    min_acceptance: float = MIN_ACCEPTANCE

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"`num_speculative_tokens` must be >= 1, got `{self.max_k}`")

    def choose(self, rows: int, drafted: int, accepted: int, remaining: int, generated: int) -> SpecDecision:
        """k for one decode row: `rows` decode rows in this step, the request's `drafted` and
        `accepted` draft tokens so far, `remaining` tokens it may still generate, `generated` so far."""
        if rows > self.max_rows:
            return SpecDecision(0, f"batch of {rows} decode rows is above {self.max_rows}: verification rows "
                                   f"would cost more than they save")
        if remaining < 2:
            return SpecDecision(0, "at most one token left to generate")
        if drafted >= WARMUP and accepted < self.min_acceptance * drafted and generated % PROBE_EVERY:
            return SpecDecision(0, f"acceptance {accepted / drafted:.2f} is below {self.min_acceptance}")
        return SpecDecision(min(self.max_k, remaining - 1), "speculating")


def ineligible(params, has_grammar: bool) -> str | None:
    """Why a request never speculates, or None. Penalties, bias and `min_tokens` are applied per
    draft position from the tokens before it, so they do not exclude a request."""
    if has_grammar:
        return "grammar-constrained: each token's mask needs the matcher advanced by the one before"
    if params.top_n_tokens:
        return "`top_n_tokens` alternatives are reported once per step"
    return None
