"""Disaggregated prefill from measured speeds: who prefills, how much of a prompt, and why.

Two decisions, both pure functions of what the router measures (each worker's step-time model
fitted over its steps, server/routing/phases.py: `a` seconds per prompt token, a decode step's
seconds at each batch size) and of its queues:

1. **Roles** (`measured_roles`, `--disaggregate auto`): the worker of the fastest measured
   prefill prefills long prompts, and the others decode them, only while its comparative
   advantage, (the best other's `a` / its `a`) / (the best other's decode step / its decode step,
   at one sequence: bound by reading the weights, and pinned even by traffic of one sequence
   at a time), is at least
   `SPLIT_ON` (2: each is better at its own phase than the other is), or `SPLIT_UNEXPECTED` where
   the cards' published figures see no such difference (a fit's noise must not split identical
   devices). It goes off again below `SPLIT_OFF`, so noise around the threshold does not flap
   the roles. The prefill worker keeps
   serving ordinary requests too (`both`): the router's drain-time cost sends them elsewhere while
   its prefill queue is long, and lets it decode when it has room. Identical devices measure an
   advantage near 1 and keep today's routing.
2. **The split of one prompt** (`plan`): the time to first token of each way to run it, with the
   prefill work already queued on each worker (`queued_s`, its prompt tokens in flight times its
   `a`), and the fastest wins:
   - *local*: the whole prompt on a decode worker d (not the prefill worker p below): `W_d + N a_d`;
   - *whole*: the whole prompt and its first token on a prefill worker p, the decode on another:
     `W_p + N a_p + HANDOFF_S`;
   - *part* (as Cronus does): the first k tokens on p while d is still busy, the rest and the
     decode on d: `max(W_p + k a_p, W_d) + (N - k) a_d + HANDOFF_S`. Where p is faster at prefill
     than d this only falls with k (so *whole* is better); where p is slower, it is least at
     `k = (W_d - W_p) / a_p`: p computes what it can before d is free. k is cut to whole KV
     blocks (the tier holds whole blocks for a longer prompt to find).
   The roles stand unless the figures clearly say otherwise: *local* is chosen over *whole* only
   when it saves at least `MIN_GAIN` of the time (the prefill worker's queue is long), and *part*
   over the other two likewise, so a fit's noise does not move work for nothing.

3. **Where a whole prompt's decode goes**: away from the prefill worker, unless the answer is
   short: `new_tokens x b_p` (what the sequence adds to p's decode steps) at most `HANDOFF_S`
   keeps it there, as an ordinary request that p prefills and decodes, with no blocks moved.

Trade-off: first-token time alone decides the prefill; where the decode goes is the router's
drain-time choice among the decode workers (the prefill worker left out), so a decode that would
be faster on the prefill worker still leaves it, which is the point when its compute is worth
more for prompts. The estimates are as good as the linear step-time model and the queues the
router counts (a worker's own queue of requests from other routers is not seen).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from server.routing.roles import AUTO_MIN_ADVANTAGE
from server.routing.speed import Speed

SPLIT_ON = AUTO_MIN_ADVANTAGE  # measured comparative advantage from which `auto` splits the phases (as the cards')
SPLIT_OFF = 1.6  # and below which it stops again
# where the cards' published figures say the devices are alike (so the start's roles do not split),
# the measurements must show this much: three identical simulated workers sharing two CPU cores
# measured 2.0 from their contention alone, which is noise, not a difference in kind
SPLIT_UNEXPECTED = 4.0
MIN_SAMPLES = 3  # sampling intervals a worker's speed must rest on before it decides anything
HANDOFF_S = 0.02  # a handoff's fixed cost: a second dispatch, the blocks written to the tier and read back
MIN_GAIN = 0.1  # a handoff (or a part over a whole) must save at least this fraction of the time
LOCAL, WHOLE, PART = "local", "whole", "part"


@dataclass(frozen=True)
class Side:
    """One worker as the split sees it: whether it may prefill for others and decode for them,
    its measured seconds per prompt token and the prefill work queued there (seconds)."""

    id: str
    prefill: bool
    decode: bool
    prefill_s: float
    queued_s: float = 0.0
    sequence_s: float = 0.0  # measured seconds a sequence adds to each of its decode steps


@dataclass(frozen=True)
class Split:
    """The choice for one prompt: `kind` LOCAL (not handed off), WHOLE (prompt and first token on
    `prefill`, decode elsewhere) or PART (`tokens` of the prompt on `prefill`, the rest and the
    decode on `decode`); `ttft_s` its estimated time to first token, `reason` the figures."""

    kind: str
    prefill: str | None = None
    decode: str | None = None
    tokens: int = 0
    ttft_s: float = 0.0
    reason: str = ""
    stays: bool = False  # WHOLE: the decode stays on the prefill worker (a short answer costs it less there)


def _ms(s: float) -> str:
    return f"{1e3 * s:.0f} ms"


def plan(sides: Sequence[Side], prompt_tokens: int, block_size: int, new_tokens: int = 0) -> Split:
    """The fastest way to a first token for a prompt of `prompt_tokens` (module docstring, 2), and
    for a WHOLE, whether an answer of `new_tokens` stays where it was prefilled (module docstring, 3)."""
    n = prompt_tokens
    whole = [(s.queued_s + n * s.prefill_s + HANDOFF_S, s) for s in sides if s.prefill]
    best_whole = min(whole, key=lambda x: (x[0], x[1].id), default=None)
    # local: on a decode worker other than that prefill worker (there, it is the same prefill, and
    # the decode that roles send elsewhere)
    local = [(s.queued_s + n * s.prefill_s, s) for s in sides
             if s.decode and (best_whole is None or s.id != best_whole[1].id)]
    best_local = min(local, key=lambda x: (x[0], x[1].id), default=None)
    parts = []
    for p in sides:
        for d in sides:
            if not (p.prefill and d.decode) or p.id == d.id or p.prefill_s <= d.prefill_s:
                continue
            k = int((d.queued_s - p.queued_s) / p.prefill_s) // block_size * block_size
            k = min(k, (n - 1) // block_size * block_size)  # at least the last token computed on d
            if k >= block_size:
                t = max(p.queued_s + k * p.prefill_s, d.queued_s) + (n - k) * d.prefill_s + HANDOFF_S
                parts.append((t, k, p, d))
    best_part = min(parts, key=lambda x: (x[0], x[2].id, x[3].id), default=None)
    if best_whole is not None and (best_local is None or best_local[0] > (1 - MIN_GAIN) * best_whole[0]):
        choice = Split(WHOLE, best_whole[1].id, None, n, best_whole[0])
    elif best_local is not None:
        choice = Split(LOCAL, None, best_local[1].id, 0, best_local[0])
    else:
        return Split(LOCAL, reason="no worker may prefill or decode it")
    if best_part is not None and best_part[0] <= (1 - MIN_GAIN) * choice.ttft_s:
        t, k, p, d = best_part
        choice = Split(PART, p.id, d.id, k, t)
    stays = choice.kind == WHOLE and best_whole[1].decode and new_tokens * best_whole[1].sequence_s <= HANDOFF_S
    reason = _reason(choice, n, best_local, best_whole)
    if stays:
        reason += (f"; its {new_tokens} new tokens cost {choice.prefill} "
                   f"{_ms(new_tokens * best_whole[1].sequence_s)} there, less than a handoff")
    return Split(choice.kind, choice.prefill, choice.decode, choice.tokens, choice.ttft_s, reason, stays)


def _reason(c: Split, n: int, best_local, best_whole) -> str:
    here = f"{_ms(best_local[0])} on {best_local[1].id}" if best_local else "no decode worker"
    if c.kind == LOCAL:
        there = f"{_ms(best_whole[0])} on {best_whole[1].id}" if best_whole else "no prefill worker"
        return f"first token sooner here: {here} against {there} with a handoff"
    if c.kind == WHOLE:
        return f"first token in {_ms(c.ttft_s)} on {c.prefill} against {here}"
    return (f"{c.tokens} of {n} prompt tokens on {c.prefill} while {c.decode} is busy, the rest on {c.decode}: "
            f"first token in {_ms(c.ttft_s)} against {here}")


@dataclass(frozen=True)
class MeasuredRoles:
    """`measured_roles`' answer: the prefill worker (None: not split) and why, with the figures."""

    prefill: str | None
    advantage: float
    reason: str


def measured_roles(speeds: Mapping[str, Speed | None], active: bool, expected: bool = True) -> MeasuredRoles | None:
    """The roles the measured speeds give (module docstring, 1), or None while some worker's speed
    rests on fewer than `MIN_SAMPLES` intervals. `active`: the roles split the phases now (the
    threshold to stay split is `SPLIT_OFF`); `expected`: the cards' figures split them (to start,
    `SPLIT_ON`; else `SPLIT_UNEXPECTED`)."""
    if len(speeds) < 2 or any(s is None or s.samples < MIN_SAMPLES for s in speeds.values()):
        return None
    known: dict[str, Speed] = {w: s for w, s in speeds.items() if s is not None}
    p = min(known, key=lambda w: (known[w].prefill_s, w))
    others = [w for w in known if w != p]
    b = min(others, key=lambda w: (known[w].step_time(1), w))
    sp, sb = known[p], known[b]
    prefill_ratio, decode_ratio = sb.prefill_s / sp.prefill_s, sb.step_time(1) / sp.step_time(1)
    advantage = prefill_ratio / decode_ratio
    figures = (f"measured: {p} prefills {prefill_ratio:.2f}x as fast as {b} and decodes {decode_ratio:.2f}x as "
               f"fast: comparative advantage {advantage:.2f}")
    threshold = SPLIT_OFF if active else SPLIT_ON if expected else SPLIT_UNEXPECTED
    if advantage < threshold:
        return MeasuredRoles(None, advantage, f"auto: not disaggregated: {figures} < {threshold:g}")
    return MeasuredRoles(p, advantage, f"auto: {p} prefills long prompts, {', '.join(others)} decode them "
                                       f"({figures} >= {threshold:g})")
