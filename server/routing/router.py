"""The router's routing state: the prefix index, speeds, sessions and load in tokens, and
the decision for each request that the balancer's filter let through.

`Router.pick(free, c, req)` is the score-and-pick stage: a request pinned to a worker goes
there (`pinned`); a request with a session goes where its session lives
(server/routing/sessions.py: `session`); otherwise the policy decides (server/routing/policy.py).
Before scoring, workers whose whole KV cache could never hold the request are set aside, as
long as another can. `Router.begin` records the dispatch (requests and tokens in flight, the
prompt's prefix on that worker, the decision counters) and returns the `Ticket` that
`end()`s it once the worker's answer or stream is over. `observe` takes the workers'
`/metrics` samples (speeds, KV use). Everything lives on the router's event loop (no locks).

Trade-off: tokens are estimated from characters (the router has no tokenizer), and load is
the sum of what the router sent and has not seen end, counted at each request's
`max_new_tokens`: requests that stop early weigh too much until they end.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

from server.balancer import Constraints
from server.routing.config import CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN, RoutingConfig
from server.routing.policy import (
    PINNED,
    SESSION,
    Ask,
    Candidate,
    Route,
    cache_aware,
    least_loaded,
    round_robin,
)
from server.routing.prefix_index import PrefixIndex
from server.routing.sessions import SessionAffinity
from server.routing.speed import PRIOR_PREFILL_TO_DECODE, Speed
from server.routing.telemetry import Telemetry
from server.worker_handle import WorkerHandle

logger = logging.getLogger(__name__)

DEFAULT_NEW_TOKENS = 100  # the workers' `max_new_tokens` when a request leaves it out
_UNMEASURED_DECODE_S = 1e-2  # seconds per generated token assumed before any worker is measured


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs of one request, computed once for all its attempts."""

    keys: tuple[int, ...]  # prefix chunk keys of its prompt
    chunk_units: int  # characters (text prompt) or token ids per chunk
    chars: int  # characters of a text prompt (0 for token ids)
    ids: int  # token ids: an id prompt, and tokens a resumed stream already has
    new_tokens: int  # tokens still to generate, at most
    session: str | None = None


@dataclass
class Ticket:
    """One dispatch to one worker; `end()` once its answer or stream is over (idempotent)."""

    router: Router
    worker: WorkerHandle
    route: Route
    prompt_tokens: float
    new_tokens: float
    ended: bool = field(default=False)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.worker.outstanding -= 1
            self.router._release(self)


class Router:
    """See the module docstring."""

    def __init__(self, config: RoutingConfig | None = None):
        self.config = config or RoutingConfig()
        self.index = PrefixIndex(self.config.chunk_chars, self.config.tree_size)
        self.telemetry = Telemetry()
        self.sessions = SessionAffinity(self.config.session_load_factor)
        self.decisions: dict[tuple[str, str], int] = {}  # (worker id, reason) -> requests sent
        self._inflight: dict[str, list[float]] = {}  # worker id -> [prompt tokens, new tokens]
        self._generation: dict[str, int] = {}  # the process whose cache the index describes
        self._last_turn: str | None = None  # round-robin

    # --- the request ---------------------------------------------------------------------
    def request(self, body: dict, c: Constraints) -> RouteRequest:
        """Routing facts of a worker request body (`inputs` or `input_ids`, `parameters`, `resume_ids`)."""
        prompt = body.get("inputs")
        if not isinstance(prompt, str):
            ids = body.get("input_ids")
            prompt = tuple(ids) if isinstance(ids, list) else ""
        resumed = body.get("resume_ids")
        resumed = len(resumed) if isinstance(resumed, list) else 0
        params = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
        asked = params.get("max_new_tokens")
        new = asked if isinstance(asked, int) and asked >= 0 else DEFAULT_NEW_TOKENS
        text = isinstance(prompt, str)
        return RouteRequest(self.index.keys(prompt), self.index.chunk_units(prompt), len(prompt) if text else 0,
                            (0 if text else len(prompt)) + resumed, max(0, new - resumed), c.session)

    def _prompt_tokens(self, req: RouteRequest) -> int:
        return self.telemetry.tokens(req.chars) + req.ids

    def _matched_tokens(self, req: RouteRequest, chunks: int) -> int:
        units = chunks * req.chunk_units
        return self.telemetry.tokens(units) if req.chars else units

    # --- score and pick ------------------------------------------------------------------
    def pick(self, free: list[WorkerHandle], c: Constraints, req: RouteRequest) -> tuple[WorkerHandle, Route]:
        """The worker among `free` (the filter's survivors, not empty) and why."""
        by_id = {h.id: h for h in free}
        for h in free:
            self._check_generation(h)
        if c.worker is not None:
            best = min(free, key=lambda h: (h.outstanding, h.picks))
            return best, Route(best.id, PINNED, f"pinned to {c.worker}")
        ask = Ask(self._prompt_tokens(req), req.new_tokens)
        cands = self._candidates(self._fitting(free, req), req)
        if req.session is not None:
            loads = {cand.id: cand.outstanding for cand in cands}
            placed = self.sessions.place(req.session, loads, list(self._generation))
            detail = f"session moved from {placed.moved_from} ({placed.why})" if placed.moved_from else "session"
            if placed.moved_from:
                logger.info("session moved from worker %s (%s) to %s", placed.moved_from, placed.why, placed.worker)
            return by_id[placed.worker], Route(placed.worker, SESSION, detail)
        policy = self.config.policy
        if policy == ROUND_ROBIN:
            route = round_robin(cands, self._last_turn)
            self._last_turn = route.worker
        elif policy == LEAST_LOADED:
            route = least_loaded(cands)
        else:
            assert policy == CACHE_AWARE
            route = cache_aware(cands, ask, self.config.balance_abs, self.config.balance_rel)
        return by_id[route.worker], route

    def _candidates(self, free: list[WorkerHandle], req: RouteRequest) -> list[Candidate]:
        speeds = {h.id: self.telemetry.speed(h.id) for h in free}
        fallback = _median_speed([s for s in speeds.values() if s is not None])
        out = []
        for h in free:
            speed = speeds[h.id] or fallback
            prompt, new = self._inflight.get(h.id, (0.0, 0.0))
            out.append(Candidate(h.id, h.outstanding, h.picks, prompt, new, speed.prefill_s, speed.decode_s,
                                 self._matched_tokens(req, self.index.match(req.keys, h.id)), self._kv_free(h)))
        return out

    def _fitting(self, free: list[WorkerHandle], req: RouteRequest) -> list[WorkerHandle]:
        """Those whose longest request (`capacity.max_seq_len`: the context, or a smaller KV
        cache) could hold this one, or all when none could: the estimate in tokens may be off,
        and the worker has the last word."""
        need = self._prompt_tokens(req) + req.new_tokens
        fit = [h for h in free if need <= _max_seq_len(h)]
        return fit or free

    def _kv_free(self, h: WorkerHandle) -> int | None:
        """Free KV cache in tokens: the worker's KV use from its last sample, over its block count."""
        capacity = h.info.capacity if h.info is not None else {}
        total, size = capacity.get("kv_blocks_total"), capacity.get("kv_block_size")
        usage = self.telemetry.kv_usage(h.id)
        if not isinstance(total, int) or not isinstance(size, int):
            return None
        if usage is None:
            free = capacity.get("kv_blocks_free")
            return free * size if isinstance(free, int) else None
        return int((1.0 - usage) * total) * size

    # --- dispatch bookkeeping --------------------------------------------------------------
    def begin(self, worker: WorkerHandle, route: Route, req: RouteRequest) -> Ticket:
        """The request goes to `worker`: count it, record its prefix there, and return its ticket."""
        self._check_generation(worker)
        held = min(self._matched_tokens(req, self.index.match(req.keys, worker.id)), self._prompt_tokens(req))
        ticket = Ticket(self, worker, route, self._prompt_tokens(req) - held, req.new_tokens)
        worker.outstanding += 1
        worker.picks += 1
        load = self._inflight.setdefault(worker.id, [0.0, 0.0])
        load[0] += ticket.prompt_tokens
        load[1] += ticket.new_tokens
        self.index.record(req.keys, worker.id)
        self.telemetry.sent(worker.id, req.chars, req.ids)
        key = (worker.id, route.reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        return ticket

    def _release(self, ticket: Ticket) -> None:
        load = self._inflight.get(ticket.worker.id)
        if load is not None:
            load[0] = max(0.0, load[0] - ticket.prompt_tokens)
            load[1] = max(0.0, load[1] - ticket.new_tokens)

    def _check_generation(self, h: WorkerHandle) -> None:
        """A new process of a worker holds no cache: forget what the index says it held."""
        if self._generation.get(h.id) != h.generation:
            if h.id in self._generation:
                self.index.drop(h.id)
            self._generation[h.id] = h.generation

    # --- what the workers report -----------------------------------------------------------
    def observe(self, h: WorkerHandle, text: str | None) -> None:
        """One `/metrics` sample of a worker (None when it did not answer)."""
        self.telemetry.observe(h.id, h.pid, text)

    def inflight(self, worker_id: str) -> tuple[float, float]:
        prompt, new = self._inflight.get(worker_id, (0.0, 0.0))
        return prompt, new

    def snapshot(self, h: WorkerHandle) -> dict:
        """`/workers` `routing`: measured speed, tokens in flight, prefix chunks held, decisions."""
        speed = self.telemetry.speed(h.id)
        prompt, new = self.inflight(h.id)
        return {
            "speed": None if speed is None else {"prefill_tokens_per_s": round(speed.prefill_tps, 1),
                                                  "decode_tokens_per_s": round(speed.decode_tps, 1),
                                                  "samples": speed.samples},
            "inflight_tokens": {"prompt": round(prompt), "new": round(new)},
            "prefix_chunks": self.index.size(h.id),
            "kv_free_tokens": self._kv_free(h),
            "decisions": {reason: n for (wid, reason), n in sorted(self.decisions.items()) if wid == h.id},
        }


def _max_seq_len(h: WorkerHandle) -> float:
    value = h.info.capacity.get("max_seq_len") if h.info is not None else None
    return value if isinstance(value, int) and value > 0 else float("inf")


def _median_speed(known: list[Speed]) -> Speed:
    """A worker not measured yet is taken to be the fleet's median."""
    if not known:
        return Speed(1.0 / (PRIOR_PREFILL_TO_DECODE * _UNMEASURED_DECODE_S), 1.0 / _UNMEASURED_DECODE_S, 0)
    return Speed(statistics.median(s.prefill_tps for s in known), statistics.median(s.decode_tps for s in known), 0)
