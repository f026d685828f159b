"""The router's routing state: the prefix index, speeds, sessions and load in tokens, and
the decision for each request that the filter let through.

`Router.pick` is the score-and-pick stage: a pinned request goes to its worker, a request with a
session where its session lives (server/routing/sessions.py), any other where the policy says
(server/routing/policy.py), after setting aside workers whose whole KV cache could never hold it
and, for a request with a LoRA adapter, those the adapter's affinity passes over
(server/routing/lora_affinity.py).
`Router.begin` records the dispatch and returns the `Ticket` that `end()`s it; `observe` takes
the workers' `/metrics` samples. Everything lives on the router's event loop (no locks).
Trade-off: tokens are estimated from characters (the router has no tokenizer), and load is the
sum of what the router sent and has not seen end, counted at each request's `max_new_tokens`:
requests that stop early weigh too much until they end.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from dataclasses import dataclass, field

from server.config.routing import CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN, TIER_HIT_WEIGHT, RoutingConfig
from server.fleet.handle import WorkerHandle
from server.routing.filter import Constraints
from server.routing.lora_affinity import AdapterSlots, adapter_pool
from server.routing.policy import (
    LORA,
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
from server.routing.speed import REFERENCE_BATCH, Speed
from server.routing.telemetry import Telemetry
from workers.contract import WireRequest, WorkerRequest

logger = logging.getLogger(__name__)

UNMEASURED = Speed(step_s=1e-2, prefill_s=1e-4, sequence_s=1e-3)  # before any worker is measured


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs of one request, computed once for all its attempts."""

    keys: tuple[int, ...]  # prefix chunk keys of its prompt
    chunk_units: int  # characters (text prompt) or token ids per chunk
    chars: int  # characters of a text prompt (0 for token ids)
    ids: int  # token ids: an id prompt, and tokens a resumed stream already has
    new_tokens: int  # tokens still to generate, at most
    session: str | None = None
    lora: str | None = None  # the LoRA adapter it runs with


@dataclass
class Ticket:
    """One dispatch to one worker; `end()` once its answer or stream is over (idempotent)."""

    router: Router
    worker: WorkerHandle
    route: Route
    keys: tuple[int, ...]  # its prompt's prefix keys
    prompt_tokens: float  # to compute there (what its cache did not hold, as estimated)
    new_tokens: float  # its max_new_tokens
    tokens: float  # the whole prompt and its max_new_tokens: what it holds in KV cache
    lora: str | None = None  # its LoRA adapter, in use there until it ends
    ended: bool = field(default=False)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.worker.outstanding -= 1
            self.router._release(self)


class Router:
    """Routing state and the pick for each request: `pick` chooses, `begin` counts the dispatch
    (requests and tokens in flight, the prompt's prefix on that worker, the decision counters)
    until its `Ticket` ends, `observe` learns from the workers' `/metrics` samples (speeds, KV use)."""

    def __init__(self, config: RoutingConfig | None = None):
        self.config = config or RoutingConfig()
        self.index = PrefixIndex(self.config.chunk_chars, self.config.tree_size)
        self.telemetry = Telemetry()
        self.sessions = SessionAffinity(self.config.load_factor)
        self.decisions: dict[tuple[str, str], int] = {}  # (worker id, reason) -> requests sent
        self._inflight: dict[str, list[float]] = {}  # worker id -> [prompt tokens to compute, new tokens, all tokens]
        self._inflight_keys: dict[str, Counter[int]] = {}  # worker id -> prefix keys of its requests in flight
        self._generation: dict[str, int] = {}  # the process whose cache the index describes
        self._tier_of: dict[str, str] = {}  # worker id -> its host KV tier (an index entry of its own)
        self._lora_inflight: dict[str, Counter[str]] = {}  # worker id -> requests in flight per LoRA adapter
        self._last_turn: str | None = None  # round-robin

    # --- the request ---------------------------------------------------------------------
    def request(self, body: WireRequest, c: Constraints) -> RouteRequest:
        """Routing facts of a request for a worker: a generation's prompt (text or token ids), its
        `max_new_tokens` and `resume_ids`; any other body (a count, an embedding) caches nothing."""
        if not isinstance(body, WorkerRequest):
            return RouteRequest(self.index.keys(""), self.index.chunk_units(""), 0, 0, 0, c.session, c.lora)
        prompt, resumed = body.prompt, len(body.resume_ids)
        text = isinstance(prompt, str)
        return RouteRequest(self.index.keys(prompt), self.index.chunk_units(prompt), len(prompt) if text else 0,
                            (0 if text else len(prompt)) + resumed,
                            max(0, body.parameters.max_new_tokens - resumed), c.session, c.lora)

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
        pool = None
        if req.lora is not None:
            slots = {h.id: AdapterSlots.from_report(h.probe.loras if h.probe is not None else None,
                                                    self._lora_inflight.get(h.id, {})) for h in free}
            inflight = {h.id: self._lora_inflight.get(h.id, {}).get(req.lora, 0) for h in free}
            pool = adapter_pool(cands, req.lora, slots, self.config.load_factor, self.config.lora_max_replicas,
                                inflight)
            cands = list(pool.candidates)
        policy = self.config.policy
        if policy == ROUND_ROBIN:
            route = round_robin(cands, self._last_turn)
            self._last_turn = route.worker
        elif policy == LEAST_LOADED:
            route = least_loaded(cands)
        else:
            assert policy == CACHE_AWARE
            route = cache_aware(cands, ask, self.config.balance_abs, self.config.balance_rel, self.config.load_factor)
        if pool is not None:
            detail = f"{pool.detail}; {route.reason}: {route.detail}"
            route = Route(route.worker, LORA, detail, route.matched, pool.tier)
        return by_id[route.worker], route

    def _candidates(self, free: list[WorkerHandle], req: RouteRequest) -> list[Candidate]:
        speeds = {h.id: self.telemetry.speed(h.id) for h in free}
        fallback = None
        if None in speeds.values():  # a worker not measured yet: the fleet's median stands in for it
            fallback = _median_speed([s for s in speeds.values() if s is not None])
        out = []
        for h in free:
            prompt, new, tokens = self.inflight(h.id)
            chunks = self.index.match(req.keys, h.id)
            sharing = self._inflight_keys.get(h.id, {}).get(req.keys[chunks - 1], 0) if chunks else 0
            out.append(Candidate(h.id, h.outstanding, h.picks, prompt, new, tokens, speeds[h.id] or fallback,
                                 self._held_tokens(req, h, chunks), self._kv_free(h), sharing))
        return out

    def _held_tokens(self, req: RouteRequest, h: WorkerHandle, chunks: int) -> int:
        """Prompt tokens the worker likely holds: the `chunks` on its device, and past them what its
        host KV tier holds (sent to any worker sharing it), at `TIER_HIT_WEIGHT`."""
        device = self._matched_tokens(req, chunks)
        tier = self._tier(h)
        beyond = self._matched_tokens(req, self.index.match(req.keys, tier)) - device if tier else 0
        return device + int(TIER_HIT_WEIGHT * beyond) if beyond > 0 else device

    def _tier(self, h: WorkerHandle) -> str | None:
        """The index entry of the host KV tier the worker reads (`capacity.kv_host_tier`: its
        directory, one per model and KV format), None without one."""
        live = h.live_capacity  # the last probe's capacity over the one reported at start
        t = live["kv_host_tier"] if "kv_host_tier" in live else (
            h.info.capacity.get("kv_host_tier") if h.info is not None else None)
        tier = f"tier:{t['directory']}" if isinstance(t, dict) and t.get("enabled") and t.get("directory") else None
        if tier is None:
            self._tier_of.pop(h.id, None)
        else:
            self._tier_of[h.id] = tier
        return tier

    def _fitting(self, free: list[WorkerHandle], req: RouteRequest) -> list[WorkerHandle]:
        """Those whose longest request (`capacity.max_seq_len`: the context, or a smaller KV
        cache) could hold this one, or all when none could: the estimate in tokens may be off,
        and the worker has the last word."""
        need = self._prompt_tokens(req) + req.new_tokens
        fit = [h for h in free if need <= _max_seq_len(h)]
        return fit or free

    def _chunks_held(self, h: WorkerHandle, req: RouteRequest) -> int | None:
        """How many prefix chunks the worker's whole KV cache holds (None: unknown)."""
        tokens = _kv_tokens(h)
        if tokens is None:
            return None
        if req.chars:
            return int(tokens * self.telemetry.chars_per_token) // req.chunk_units
        return tokens // req.chunk_units

    def _kv_free(self, h: WorkerHandle) -> int | None:
        """Free KV cache in tokens: `capacity.kv_blocks_free` from the worker's last `/health`
        probe, else its KV use from its last `/metrics` sample, over its block count."""
        capacity = h.info.capacity if h.info is not None else {}
        total, size = capacity.get("kv_blocks_total"), capacity.get("kv_block_size")
        if not isinstance(total, int) or not isinstance(size, int):
            return None
        free = h.live_capacity.get("kv_blocks_free")
        if isinstance(free, int):
            return free * size
        usage = self.telemetry.kv_usage(h.id)
        if usage is None:
            free = capacity.get("kv_blocks_free")
            return free * size if isinstance(free, int) else None
        return int((1.0 - usage) * total) * size

    # --- dispatch bookkeeping --------------------------------------------------------------
    def begin(self, worker: WorkerHandle, route: Route, req: RouteRequest) -> Ticket:
        """The request goes to `worker`: count it, record its prefix there, and return its ticket."""
        self._check_generation(worker)
        prompt = self._prompt_tokens(req)
        held = min(self._held_tokens(req, worker, self.index.match(req.keys, worker.id)), prompt)
        ticket = Ticket(self, worker, route, req.keys, prompt - held, req.new_tokens, prompt + req.new_tokens,
                        req.lora)
        if req.lora is not None:
            self._lora_inflight.setdefault(worker.id, Counter())[req.lora] += 1
        worker.outstanding += 1
        worker.picks += 1
        load = self._inflight.setdefault(worker.id, [0.0, 0.0, 0.0])
        load[0] += ticket.prompt_tokens
        load[1] += ticket.new_tokens
        load[2] += ticket.tokens
        self._inflight_keys.setdefault(worker.id, Counter()).update(req.keys)
        self.index.record(req.keys, worker.id, self._chunks_held(worker, req))
        tier = self._tier(worker)
        if tier is not None:  # its blocks are written through to the tier every worker of the group reads
            self.index.record(req.keys, tier)
        self.telemetry.sent(worker.id, req.chars, req.ids)
        key = (worker.id, route.reason)
        self.decisions[key] = self.decisions.get(key, 0) + 1
        return ticket

    def _release(self, ticket: Ticket) -> None:
        adapters = self._lora_inflight.get(ticket.worker.id)
        if ticket.lora is not None and adapters is not None:
            adapters[ticket.lora] -= 1
            if adapters[ticket.lora] <= 0:
                del adapters[ticket.lora]
        load = self._inflight.get(ticket.worker.id)
        if load is not None:
            load[0] = max(0.0, load[0] - ticket.prompt_tokens)
            load[1] = max(0.0, load[1] - ticket.new_tokens)
            load[2] = max(0.0, load[2] - ticket.tokens)
        keys = self._inflight_keys.get(ticket.worker.id)
        if keys is not None:
            keys.subtract(ticket.keys)
            for key in set(ticket.keys):
                if keys.get(key, 1) <= 0:
                    del keys[key]

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
        self._tier(h)  # which workers share a host KV tier, as `/workers` shows it

    def inflight(self, worker_id: str) -> tuple[float, float, float]:
        """(prompt tokens to compute, new tokens, all tokens) in flight on the worker."""
        prompt, new, tokens = self._inflight.get(worker_id, (0.0, 0.0, 0.0))
        return prompt, new, tokens

    def snapshot(self, h: WorkerHandle) -> dict:
        """`/workers` `routing`: measured speed, tokens in flight, prefix chunks held, decisions."""
        speed, phases = self.telemetry.speed(h.id), self.telemetry.phases(h.id)
        prompt, new, tokens = self.inflight(h.id)
        return {
            "speed": None if speed is None else speed_entry(speed),
            "phases": None if phases is None else speed_entry(phases),  # fitted over steps: disaggregation's
            "inflight_tokens": {"to_prefill": round(prompt), "new": round(new), "total": round(tokens)},
            "prefix_chunks": self.index.size(h.id),
            **self._tier_entry(h),
            "kv_free_tokens": self._kv_free(h),
            "decisions": {reason: n for (wid, reason), n in sorted(self.decisions.items()) if wid == h.id},
        }


    def _tier_entry(self, h: WorkerHandle) -> dict:
        """`/workers` `routing.host_tier`: the workers sharing its host KV tier, the prefix chunks
        the router counts there."""
        tier = self._tier(h)
        if tier is None:
            return {}
        return {"host_tier": {"shared_with": sorted(w for w, t in self._tier_of.items() if t == tier and w != h.id),
                              "prefix_chunks": self.index.size(tier)}}


def _kv_tokens(h: WorkerHandle) -> int | None:
    """The worker's whole KV cache in tokens, when it reports one."""
    capacity = h.info.capacity if h.info is not None else {}
    total, size = capacity.get("kv_blocks_total"), capacity.get("kv_block_size")
    return total * size if isinstance(total, int) and isinstance(size, int) else None


def _max_seq_len(h: WorkerHandle) -> float:
    value = h.info.capacity.get("max_seq_len") if h.info is not None else None
    return value if isinstance(value, int) and value > 0 else float("inf")


def _median_speed(known: list[Speed]) -> Speed:
    """A worker not measured yet is taken to be the fleet's median (all alike before any is)."""
    if not known:
        return UNMEASURED
    return Speed(statistics.median(s.step_s for s in known), statistics.median(s.prefill_s for s in known),
                 statistics.median(s.sequence_s for s in known))


def speed_entry(speed: Speed) -> dict:
    """`/workers` `routing.speed`: the step-time model and what it means in tokens per second."""
    return {"prefill_tokens_per_s": round(speed.prefill_tps, 1),
            "decode_tokens_per_s": round(speed.decode_tps(1), 1),
            f"decode_tokens_per_s_batch_{REFERENCE_BATCH}": round(speed.decode_tps(REFERENCE_BATCH), 1),
            "step_ms": round(1e3 * speed.step_s, 4), "per_sequence_ms": round(1e3 * speed.sequence_s, 4),
            "samples": speed.samples}
