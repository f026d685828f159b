"""The routing policies' score and pick stages, as pure functions of what the router knows.

The filter stage (ready, breaker closed, not failed before, room in its queue, the request's
constraints) is server/balancer.py; server/routing/router.py turns each worker that passed
into a `Candidate` and calls one of these.

`cache_aware` decides in this order, as SGLang's cache-aware router does, with the load and
the speed of unequal workers counted in:

1. **imbalance**: when the loads are uneven (the most loaded worker's exceeds the least
   loaded one's by more than `balance_abs` tokens and is more than `balance_rel` times as
   large; a load is the tokens in flight there, scaled by the worker's speed relative to the
   fleet's median, so a worker twice as fast counts half) the least loaded worker gets the
   request, whatever it holds: a hot prefix cannot pile everything onto one worker;
2. **prefix**: otherwise the workers that hold the longest prefix of the prompt compete, and
3. among them (or among all, when none holds any) the one that would be done soonest wins,
   by its estimated engine-seconds, as a processor-sharing server sees them:

       backlog  = in-flight prompt tokens x a + in-flight new tokens x b
       own      = (prompt tokens - tokens of its prefix the worker holds) x a + new tokens x b
       kv wait  = tokens beyond the worker's free KV cache x b          (when it reports it)
       cost     = backlog + own + kv wait

   with a and b the worker's measured seconds per prompt and per generated token
   (server/routing/speed.py). Ties go to fewer requests in flight, then to the worker picked
   least often.

Trade-off: prefix first. A conversation stays on the worker holding its history while the
loads are within the thresholds, even when another worker would answer this one request a
little sooner: the cost model alone counts only the prefill one request saves, not what the
same cache saves the turns that follow, nor the cache a move would duplicate elsewhere.
The thresholds bound how uneven that may make the loads.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

HEADER_ROUTE = "X-Hetserve-Route"  # on every answer a worker gave: why that worker (`Route.header`)

PREFIX, SESSION, LEAST_LOADED, PINNED, IMBALANCE, ROUND_ROBIN = (
    "prefix", "session", "least-loaded", "pinned", "imbalance", "round-robin")
REASONS = (PREFIX, SESSION, LEAST_LOADED, PINNED, IMBALANCE, ROUND_ROBIN)


@dataclass(frozen=True)
class Candidate:
    """One worker that can take the request, as the policy sees it."""

    id: str
    outstanding: int = 0  # requests in flight
    picks: int = 0  # requests ever sent (tie-break)
    inflight_prompt: float = 0.0  # prompt tokens in flight (what its cache did not hold, as estimated)
    inflight_new: float = 0.0  # new tokens in flight (their max_new_tokens)
    prefill_s: float = 1e-4  # seconds per prompt token
    decode_s: float = 1e-3  # seconds per generated token
    matched: int = 0  # tokens of the request's prompt this worker likely holds
    kv_free: int | None = None  # free KV cache, in tokens, when known


@dataclass(frozen=True)
class Ask:
    """The request, as the policy sees it."""

    prompt_tokens: int
    new_tokens: int


@dataclass(frozen=True)
class Route:
    """A pick and why: `reason` one of REASONS; `header` what `X-Hetserve-Route` says."""

    worker: str
    reason: str
    detail: str = ""
    matched: int = 0

    @property
    def header(self) -> str:
        return f"{PREFIX}:{self.matched}" if self.reason == PREFIX else self.reason


def backlog_s(c: Candidate) -> float:
    """Engine-seconds of the work already in flight there."""
    return c.inflight_prompt * c.prefill_s + c.inflight_new * c.decode_s


def cost_s(c: Candidate, ask: Ask, use_prefix: bool = True) -> float:
    """Engine-seconds until the request would be done there (see the module docstring)."""
    held = min(c.matched, ask.prompt_tokens) if use_prefix else 0
    compute = ask.prompt_tokens - held
    wait = 0.0
    if c.kv_free is not None:
        wait = max(0, compute + ask.new_tokens - c.kv_free) * c.decode_s
    return backlog_s(c) + compute * c.prefill_s + ask.new_tokens * c.decode_s + wait


def loads(cands: Sequence[Candidate]) -> dict[str, float]:
    """In-flight tokens of each candidate, scaled by its speed relative to the median: a worker
    twice as fast as the median counts half its tokens."""
    median = statistics.median(c.decode_s for c in cands)
    return {c.id: (c.inflight_prompt + c.inflight_new) * c.decode_s / median for c in cands}


def imbalanced(load: dict[str, float], balance_abs: float, balance_rel: float) -> bool:
    high, low = max(load.values()), min(load.values())
    return high - low > balance_abs and high > balance_rel * low


def _tie(c: Candidate) -> tuple[int, int, str]:
    return c.outstanding, c.picks, c.id


def cache_aware(cands: Sequence[Candidate], ask: Ask, balance_abs: float, balance_rel: float) -> Route:
    """Imbalance, then the longest prefix, then the soonest done (see the module docstring)."""
    load = loads(cands)
    if len(cands) > 1 and imbalanced(load, balance_abs, balance_rel):
        best = min(cands, key=lambda c: (load[c.id], *_tie(c)))
        return Route(best.id, IMBALANCE, f"load {load[best.id]:.0f} tokens, the most loaded {max(load.values()):.0f}")
    most = max(c.matched for c in cands)
    holders = [c for c in cands if c.matched == most] if most > 0 else list(cands)
    best = min(holders, key=lambda c: (cost_s(c, ask), *_tie(c)))
    done = f"done in {cost_s(best, ask):.3f}s of engine time"
    if most > 0 and (len(holders) < len(cands) or len(cands) == 1):
        held = min(most, ask.prompt_tokens)
        return Route(best.id, PREFIX, f"holds {held} of {ask.prompt_tokens} prompt tokens, {done}", held)
    return Route(best.id, LEAST_LOADED, done)


def least_loaded(cands: Sequence[Candidate]) -> Route:
    """Fewest requests in flight; ties to the one picked least often."""
    best = min(cands, key=_tie)
    return Route(best.id, LEAST_LOADED, f"{best.outstanding} requests in flight")


def round_robin(cands: Sequence[Candidate], last: str | None) -> Route:
    """The first candidate after `last` in id order (wrapping around)."""
    ordered = sorted(cands, key=lambda c: c.id)
    after = [c for c in ordered if last is None or c.id > last]
    best = (after or ordered)[0]
    return Route(best.id, ROUND_ROBIN, f"after {last or 'none'}")
