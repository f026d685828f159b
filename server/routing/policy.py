"""The routing policies' score and pick stages, as pure functions of what the router knows.

server/routing/router.py turns each worker that passed the filter (server/routing/filter.py) into
a `Candidate` and calls one of these. `cache_aware` decides as SGLang's cache-aware router does
(imbalance, then the longest held prefix, then the soonest drained), with the load and the
measured speed of unequal workers counted in, so work spreads in proportion to speed and a held
prefix saves exactly the prefill it avoids. Trade-off: prefix first. A conversation stays on
the worker holding its history while the loads are within the thresholds, even when another
would drain a little sooner: the cost counts only the prefill one request saves, not what the
same cache saves the turns that follow, nor the cache a move would duplicate; the thresholds
bound how uneven that may make the loads. And a drain time, not a latency: a fast worker with a
few requests more may answer sooner than an idle slow one (batching), but spreading in
proportion to speed keeps every worker's queue short and none idle.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from server.config.routing import DEFAULT_LOAD_FACTOR
from server.routing.speed import Speed

HEADER_ROUTE = "X-Hetserve-Route"  # on every answer a worker gave: why that worker (`Route.header`)

PREFIX, SESSION, LEAST_LOADED, PINNED, IMBALANCE, ROUND_ROBIN, LORA = (
    "prefix", "session", "least-loaded", "pinned", "imbalance", "round-robin", "lora")
REASONS = (PREFIX, SESSION, LEAST_LOADED, PINNED, IMBALANCE, ROUND_ROBIN, LORA)


@dataclass(frozen=True)
class Candidate:
    """One worker that can take the request, as the policy sees it."""

    id: str
    outstanding: int = 0  # requests in flight
    picks: int = 0  # requests ever sent (tie-break)
    inflight_prompt: float = 0.0  # prompt tokens in flight that its cache did not hold (estimated)
    inflight_new: float = 0.0  # new tokens in flight (their max_new_tokens)
    inflight_tokens: float = 0.0  # all tokens in flight: whole prompts and their max_new_tokens
    speed: Speed = Speed(step_s=1e-3, prefill_s=1e-4, sequence_s=1e-4)
    matched: int = 0  # tokens of the request's prompt this worker likely holds
    kv_free: int | None = None  # free KV cache, in tokens, when known
    sharing: int = 0  # requests in flight there that share the prefix it holds of this prompt


@dataclass(frozen=True)
class Ask:
    """The request, as the policy sees it."""

    prompt_tokens: int
    new_tokens: int


@dataclass(frozen=True)
class Route:
    """A pick and why: `reason` one of REASONS; `header` what `X-Hetserve-Route` says (`prefix:N`
    with the tokens held, `lora:TIER` with server/routing/lora_affinity.py's tier)."""

    worker: str
    reason: str
    detail: str = ""
    matched: int = 0
    tier: str = ""  # LORA: the adapter tier that narrowed the pick

    @property
    def header(self) -> str:
        if self.reason == LORA:
            return f"{LORA}:{self.tier}"
        return f"{PREFIX}:{self.matched}" if self.reason == PREFIX else self.reason


def cost_s(c: Candidate, ask: Ask) -> float:
    """Engine-seconds to drain the work in flight there with this request added, from the worker's
    measured speed (server/routing/speed.py: a per prompt token, t per generated token at a batch
    of 8):

        cost = (prompt tokens in flight there, and this prompt's that it does not hold) x a
             + (new tokens in flight there, and this request's) x t
             + (this request's tokens beyond its free KV cache) x t   (when the worker reports it)
    """
    compute = ask.prompt_tokens - min(c.matched, ask.prompt_tokens)
    wait = max(0, compute + ask.new_tokens - c.kv_free) if c.kv_free is not None else 0
    return ((c.inflight_prompt + compute) * c.speed.prefill_s
            + (c.inflight_new + ask.new_tokens + wait) * c.speed.token_s)


def loads(cands: Sequence[Candidate]) -> dict[str, float]:
    """Tokens in flight on each candidate, scaled by its speed relative to the median: a worker
    twice as fast as the median counts half its tokens."""
    median = statistics.median(c.speed.token_s for c in cands)
    return {c.id: c.inflight_tokens * c.speed.token_s / median for c in cands}


def imbalanced(load: dict[str, float], balance_abs: float, balance_rel: float) -> bool:
    high, low = max(load.values()), min(load.values())
    return high - low > balance_abs and high > balance_rel * low


def bounded_load(outstanding: Iterable[int], factor: float) -> int:
    """The most requests a worker may have in flight, a new one included, under bounded loads:
    `factor` x the mean (the new one counted), plus one (at light load a request more is noise)."""
    counts = list(outstanding)
    return math.ceil(factor * (sum(counts) + 1) / max(1, len(counts))) + 1


def _tie(c: Candidate) -> tuple[int, int, str]:
    return c.outstanding, c.picks, c.id


def cache_aware(cands: Sequence[Candidate], ask: Ask, balance_abs: float, balance_rel: float,
                load_factor: float = DEFAULT_LOAD_FACTOR) -> Route:
    """Imbalance, then the longest prefix, then the soonest done, in this order:

    1. **imbalance**: when the loads are uneven (`loads`: the most loaded worker's exceeds the
       least loaded one's by more than `balance_abs` tokens and is more than `balance_rel` times
       as large; a prompt counts whole, cached or not, as it holds KV cache either way) the least
       loaded worker gets the request, whatever it holds: a hot prefix cannot pile everything
       onto one worker;
    2. **prefix**: otherwise the workers that hold the longest prefix of the prompt compete,
       unless that prefix is **hot** there (other requests in flight share it: a system prompt
       many clients send, not a conversation's own history): then every worker competes, as
       one prefill copies a hot prefix to another worker and pays for itself many times;
    3. when the request is open to every worker (no worker holds any of it, or it is hot), only
       the workers within `bounded_load` compete, so that neither new conversations nor a hot
       prompt pile onto the fastest worker, whose KV cache holds no more than the others';
    4. among them the one that would drain soonest wins (`cost_s`). Ties go to fewer requests
       in flight, then to the worker picked least often.
    """
    load = loads(cands)
    if len(cands) > 1 and imbalanced(load, balance_abs, balance_rel):
        best = min(cands, key=lambda c: (load[c.id], *_tie(c)))
        most_loaded = max(load.values())
        return Route(best.id, IMBALANCE, f"load {load[best.id]:.0f} tokens, the most loaded {most_loaded:.0f}")
    most = max(c.matched for c in cands)
    holders = [c for c in cands if c.matched == most] if most > 0 else list(cands)
    hot = any(c.sharing for c in holders)
    pool = list(cands) if hot or most == 0 else holders
    if len(pool) == len(cands):  # open to all: within the bound on requests in flight
        bound = bounded_load((c.outstanding for c in cands), load_factor)
        pool = [c for c in pool if c.outstanding + 1 <= bound] or pool
    best = min(pool, key=lambda c: (cost_s(c, ask), *_tie(c)))
    done = f"done in {cost_s(best, ask):.3f}s of engine time"
    if most > 0 and best.matched == most and (len(holders) < len(cands) or len(cands) == 1):
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
