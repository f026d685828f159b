"""How many draft tokens the decode rows carry this step (k, 0 included), with the reason.

Design: a verified draft costs a query token whether it is accepted or not, and what a query token
costs depends on the device and its load: nearly nothing on a memory-bound GPU at a small batch, its
full share on a compute-bound CPU or in a full batch. So each step, from the worker's own measured
step costs (workers/spec/cost.py) and each row's acceptance rate (its own, shrunk toward the
method's rate while it has few draft tokens), k is the value in 0..max_k that maximizes the expected
tokens per second: a row accepting each draft with probability a emits 1 + a + ... + a^k tokens in a
step whose cost is the measured (or extrapolated) cost of its query tokens, against B tokens for the
plain step's cost. Speculation thus turns itself off in a batch large enough that the extra query
tokens cost more than they return, and on a device where they are dear. Per row, as before: no
drafts when at most one token is left, and none while its running acceptance is below
`min_acceptance` after `WARMUP` draft tokens (one probe every `PROBE_EVERY` tokens, so a request
whose text turns repetitive recovers). Before a path is measured the policy measures it: a few plain
steps at each batch size, then speculative steps while the batch has at most `EXPLORE_ROWS` rows,
and it weighs k only up to twice the query tokens measured, so the measured range grows with the
batches where speculation is taken; every `REFRESH` steps it takes the path it has not been taking
(the speculative one only in a batch of at most `EXPLORE_ROWS` rows, where the probe is cheap), so
both stay current as the load changes. `max_rows` (tests and benchmarks) replaces the measured
choice with a fixed rule: k = max_k up to `max_rows` decode rows, else 0. Each row gets its own k:
its j-th draft is worth rate^j expected tokens, so the step takes the m most valuable drafts over all
rows, for the m whose step (rows + m query tokens) gives the most tokens/s; a row that accepts well
drafts further than one that does not. Trade-off: a geometric model of acceptance and one cost line
per path (not per row's context): at most rows x max_k candidates evaluated per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from workers.spec.cost import StepCosts

DEFAULT_NUM_SPECULATIVE_TOKENS = 4
MIN_ACCEPTANCE = 0.25  # below this running rate (after `WARMUP` draft tokens) a request stops drafting
WARMUP = 16
PROBE_EVERY = 16
EXPLORE_ROWS = 4  # before the speculative path is measured, batches up to this many rows try it
PLAIN_SAMPLES = 3  # plain steps measured at a batch size before speculating at it
REFRESH = 64  # every this many steps, the path not taken is measured again
MIN_GAIN = 1.05  # speculate when the expected tokens/s are at least this many times the plain step's
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 8  # a row's acceptance before it has draft tokens of its own


@dataclass(frozen=True)
class SpecDecision:
    k: int
    reason: str
    cause: str = "measured"  # a short name for `/metrics`: measured, measuring, cost, batch, acceptance, length
    ks: tuple[int, ...] = ()  # each drafting row's own k, in `choose`'s order (empty: `k`, capped by its limit)


@dataclass(frozen=True)
class Row:
    """A decode row as the step's choice sees it: its draft's length and its acceptance estimate."""

    drafts: int  # the most draft tokens it may carry (its own limit)
    rate: float


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a row emits with k drafts, each accepted with probability `rate` while the ones before were."""
    return float(k + 1) if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)


def row_rate(drafted: int, accepted: int, prior: float) -> float:
    """A row's acceptance estimate: its own rate, shrunk toward `prior` while it has few draft tokens."""
    return min(0.99, (accepted + prior * PRIOR_WEIGHT) / (drafted + PRIOR_WEIGHT))


@dataclass(frozen=True)
class SpecPolicy:
    max_k: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    max_rows: int | None = None  # a fixed rule instead of the measured choice (see the module docstring)
    min_acceptance: float = MIN_ACCEPTANCE

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"`num_speculative_tokens` must be >= 1, got `{self.max_k}`")

    def row_limit(self, drafted: int, accepted: int, remaining: int, generated: int) -> SpecDecision:
        """The most drafts one decode row may carry: its `drafted` and `accepted` draft tokens so far,
        `remaining` tokens it may still generate, `generated` so far."""
        if remaining < 2:
            return SpecDecision(0, "at most one token left to generate", "length")
        if drafted >= WARMUP and accepted < self.min_acceptance * drafted and generated % PROBE_EVERY:
            return SpecDecision(0, f"acceptance {accepted / drafted:.2f} is below {self.min_acceptance}", "acceptance")
        return SpecDecision(min(self.max_k, remaining - 1), "speculating")

    def choose(self, rows: int, drafting: Sequence[Row], costs: StepCosts, step: int) -> SpecDecision:
        """k for this step: `rows` decode rows, `drafting` those with drafts proposed, `step` the
        engine's step count (for the periodic refresh)."""
        if not drafting:
            return SpecDecision(0, "no decode row may draft", "acceptance")
        if self.max_rows is not None:
            if rows > self.max_rows:
                return SpecDecision(0, f"batch of {rows} decode rows is above {self.max_rows}", "batch")
            return SpecDecision(self.max_k, f"at most {self.max_rows} decode rows: k = {self.max_k}")
        if costs.samples("plain", rows) < PLAIN_SAMPLES:
            return SpecDecision(0, f"measuring the plain step at {rows} decode rows", "measuring")
        top = max(r.drafts for r in drafting)
        refresh = step % REFRESH == 0
        if costs.sizes("spec") < 2:
            if rows <= EXPLORE_ROWS:
                return SpecDecision(top, f"measuring the speculative step at {rows} decode rows", "measuring")
            return SpecDecision(0, f"speculative step not measured yet and {rows} decode rows are above "
                                   f"{EXPLORE_ROWS}", "batch")
        reach = 2 * costs.largest("spec")  # the line is trusted up to here
        if rows + 1 > reach:
            return SpecDecision(0, f"speculative step measured up to {reach // 2} query tokens, not near "
                                   f"{rows + 1}", "batch")
        plain = costs.estimate("plain", rows).seconds
        # per row: its j-th draft adds rate^j expected tokens; the m most valuable drafts of the step, for the
        # m that maximizes tokens/s, give each row its own k (a row's values fall with j, so it gets a prefix)
        gains = sorted(((r.rate ** (j + 1), i) for i, r in enumerate(drafting) for j in range(r.drafts)),
                       key=lambda g: -g[0])
        best_m, best_gain, best, tokens = 0, 1.0, None, float(rows)
        for m, (value, _) in enumerate(gains[: reach - rows], 1):
            tokens += value
            spec = costs.estimate("spec", rows + m).seconds
            gain = (tokens / spec) / (rows / plain)
            if gain > best_gain:
                best_m, best_gain, best = m, gain, (tokens, spec)
        if best_m and best_gain >= MIN_GAIN:
            if refresh:
                return SpecDecision(0, "refreshing the plain step's cost", "measuring")
            tokens, spec = best
            ks = [0] * len(drafting)
            for _, i in gains[:best_m]:
                ks[i] += 1
            k = max(ks)
            return SpecDecision(k, f"k={k} ({best_m} drafts over {sum(n > 0 for n in ks)} rows): {tokens:.2f} "
                                   f"tokens expected from {rows} decode rows in {spec * 1e3:.2f} ms against {rows} "
                                   f"in {plain * 1e3:.2f} ms plain ({best_gain:.2f}x tokens/s)", ks=tuple(ks))
        if refresh and rows <= EXPLORE_ROWS:  # a small batch: the probe costs little
            return SpecDecision(top, "refreshing the speculative step's cost", "measuring")
        mean = sum(r.rate for r in drafting) / len(drafting)
        return SpecDecision(0, f"no k pays {MIN_GAIN}x at {rows} decode rows (acceptance {mean:.2f}, plain step "
                               f"{plain * 1e3:.2f} ms; best {best_gain:.2f}x)", "cost")


def ineligible(params, has_grammar: bool) -> str | None:
    """Why a request never speculates, or None. Penalties, bias and `min_tokens` are applied per
    draft position from the tokens before it, so they do not exclude a request."""
    if has_grammar:
        return "grammar-constrained: each token's mask needs the matcher advanced by the one before"
    if params.top_n_tokens:
        return "`top_n_tokens` alternatives are reported once per step"
    return None
