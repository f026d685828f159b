"""What the canary compares, and how a worker's answers become a verdict (pure, no I/O).

Each canary sequence is a prompt plus the reference's greedy continuation, scored by every
worker teacher-forced (`input_ids`, `max_new_tokens: 0`, `decoder_input_details`,
`top_n_tokens`): every position is judged on its own, along the same tokens for every worker
(the measure of benchmarks/fp8_agreement.py), where a free-running comparison would lose every
position after the first flipped token. `compare` gives the agreement (positions whose best
token equals the other side's) and the largest logprob difference; `expectation` says whether
it must be exact (both sides deterministic with the same `Numerics`) or at least
`--canary-min-agreement` (docs/deterministic-and-canary.md). Trade-off: a reference recorded
from a worker that was already bad at start-up is only outvoted where other workers disagree
with it; a single worker is compared with itself over time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from server.fleet.canary_record import HEALTHY, SUSPECT
from workers.contract import CapabilityPayload


@dataclass(frozen=True)
class Position:
    """One scored position: the token that follows, its logprob and the best alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first

    @property
    def best(self) -> int:
        return self.top[0][0] if self.top else self.token


@dataclass(frozen=True)
class Scored:
    """A worker's scores of one canary sequence, position by position."""

    positions: tuple[Position, ...]


def parse_scores(body: Mapping) -> Scored:
    """The scores in a worker's `/generate` answer to a scoring request (`details.prefill`; the
    first prompt token has no logprob and is skipped)."""
    prefill = (body.get("details") or {}).get("prefill") or []
    positions = []
    for entry in prefill[1:]:
        top = tuple((int(t["id"]), float(t["logprob"])) for t in entry.get("top_tokens") or ())
        positions.append(Position(int(entry["id"]), float(entry["logprob"]), top))
    if not positions:
        raise ValueError("the answer holds no scored positions (`details.prefill` with logprobs)")
    return Scored(tuple(positions))


def parse_generation(body: Mapping) -> tuple[list[int], list[int]]:
    """(prompt token ids, generated token ids) of a `/generate` answer with `details` and
    `decoder_input_details`."""
    details = body.get("details") or {}
    prompt = [int(e["id"]) for e in details.get("prefill") or ()]
    generated = [int(t["id"]) for t in details.get("tokens") or ()]
    if not prompt:
        raise ValueError("the answer holds no prompt tokens (`details.prefill`)")
    return prompt, generated


@dataclass(frozen=True)
class Numerics:
    """What decides a worker's numbers, beyond its weights: equal values and deterministic mode
    on both sides mean the canary expects exact agreement."""

    dtype: str | None
    device_type: str | None
    fp8: str | None
    kernels: tuple[tuple[str, str], ...]  # (layer, variant), sorted
    deterministic: tuple | None  # (row tile, kv split, attention) when enabled

    @classmethod
    def of(cls, info: CapabilityPayload) -> Numerics:
        det = info.deterministic
        return cls(info.model.dtype, info.device.type, info.fp8.convention,
                   tuple(sorted((layer, k.variant) for layer, k in info.kernels.items())),
                   (det.row_tile, det.kv_split, det.attention) if det is not None and det.enabled else None)

    def exact_with(self, other: Numerics) -> bool:
        return self.deterministic is not None and self == other


@dataclass(frozen=True)
class Reference:
    """The canary sequences of one model and the scores every worker is compared with.

    Recorded once per model, from the first round that has a result: each prompt's continuation
    is the one most workers generated (`consensus`), and the scores are those of the worker that
    agreed with that consensus on the most prompts, whose numerics are recorded with them. Later
    rounds, and workers that join or restart later, are compared with that same record, so a
    worker that drifts over time is caught even when it is alone."""

    model: str
    sequences: tuple[tuple[int, ...], ...]  # prompt + reference continuation, per canary prompt
    scores: tuple[Scored, ...]
    origin: str  # the worker whose scores these are
    numerics: Numerics
    recorded_at: float  # unix time

    def describe(self) -> dict:
        return {"worker": self.origin, "model": self.model, "recorded_at": round(self.recorded_at, 3),
                "deterministic": self.numerics.deterministic is not None, "dtype": self.numerics.dtype,
                "fp8": self.numerics.fp8}


def consensus(continuations: Sequence[Sequence[tuple[int, ...]]]) -> list[int]:
    """For each prompt, the index of the worker whose continuation the most workers generated
    (`continuations[w][p]`: worker w's tokens for prompt p; ties: the first such worker)."""
    picks = []
    for p in range(len(continuations[0])):
        counts = Counter(c[p] for c in continuations)
        top = max(counts.values())
        picks.append(next(w for w, c in enumerate(continuations) if counts[c[p]] == top))
    return picks


@dataclass(frozen=True)
class Comparison:
    agreement: float  # fraction of positions whose best token equals the other side's
    max_logprob_diff: float
    positions: int


def compare(mine: Sequence[Scored], theirs: Sequence[Scored]) -> Comparison:
    """Agreement and largest logprob difference of two workers' scores of the same sequences:
    the fraction of positions where the best tokens (the greedy choices) are equal, and over
    every position the largest |difference| of the logprob of the token that follows and of
    each token in both top lists."""
    same = total = 0
    worst = 0.0
    for a, b in zip(mine, theirs, strict=True):
        if len(a.positions) != len(b.positions):
            raise ValueError(
                f"scored {len(a.positions)} positions against {len(b.positions)}: not the same sequence")
        for x, y in zip(a.positions, b.positions, strict=True):
            total += 1
            same += x.best == y.best
            diffs = [abs(x.logprob - y.logprob)] if x.token == y.token else []
            ours = dict(x.top)
            diffs += [abs(ours[t] - lp) for t, lp in y.top if t in ours]
            worst = max(worst, *diffs) if diffs else worst
    return Comparison(same / total if total else 1.0, worst if math.isfinite(worst) else float("inf"), total)


@dataclass(frozen=True)
class Expectation:
    exact: bool
    min_agreement: float

    def describe(self) -> str:
        return "exact" if self.exact else f">= {self.min_agreement:g}"

    def judge(self, c: Comparison) -> tuple[str, str]:
        """(verdict, reason)."""
        if self.exact:
            if c.agreement == 1.0 and c.max_logprob_diff == 0.0:
                return HEALTHY, "identical to the reference (deterministic, same numerics)"
            return SUSPECT, (f"differs from the reference although both run deterministic with the same "
                             f"numerics: agreement {c.agreement:.4f}, largest logprob difference "
                             f"{c.max_logprob_diff:.3g}")
        if c.agreement >= self.min_agreement:
            return HEALTHY, f"agreement {c.agreement:.4f} >= {self.min_agreement:g}"
        return SUSPECT, f"agreement {c.agreement:.4f} < {self.min_agreement:g} over {c.positions} positions"


def expectation(worker: Numerics, reference: Numerics, min_agreement: float) -> Expectation:
    return Expectation(worker.exact_with(reference), min_agreement)


