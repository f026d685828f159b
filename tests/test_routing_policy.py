"""The routing policy's pieces, pure: prefix index, speed fit, sessions, scoring, the router's
state over the filter, configuration, and the benchmarks' slow-down knob."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.cli import build_parser
from server.config.routing import LEAST_LOADED, RoutingConfig, routing_from_args
from server.config.settings import RouterSettings
from server.errors import UsageError
from server.fleet.breaker import BreakerPolicy, CircuitBreaker
from server.fleet.handle import WorkerHandle
from server.fleet.spec import build_worker_specs
from server.routing.filter import WAIT, Constraints, parse_constraints
from server.routing.policy import (
    IMBALANCE,
    PREFIX,
    Ask,
    Candidate,
    Route,
    bounded_load,
    cache_aware,
    cost_s,
    least_loaded,
    round_robin,
)
from server.routing.prefix_index import PrefixIndex, prefix_keys
from server.routing.router import Router
from server.routing.sessions import OVERLOADED, UNAVAILABLE, SessionAffinity
from server.routing.speed import Speed, SpeedFit
from server.routing.telemetry import Counters, Telemetry
from tests.routing_helpers import PICK, choose
from workers.contract import CapabilityPayload, WorkerRequest, WorkerState, parse_simulate
from workers.contract.slowdown import device_slowdown, slowdown_factor
from workers.device.slowdown import apply_slowdown

CHUNK = 64


def _text(n_chunks: int, tag: str) -> str:
    return "".join(f"{tag}-{i:04d}".ljust(CHUNK, ".") for i in range(n_chunks))


# --- prefix index ------------------------------------------------------------------------
def test_prefix_keys_name_whole_prefixes_and_skip_a_partial_chunk():
    shared = _text(3, "system")
    a, b = prefix_keys(shared + _text(2, "alice")), prefix_keys(shared + _text(2, "bob") + "tail")
    assert len(a) == len(b) == 5  # "tail" is a partial chunk: no key
    assert a[:3] == b[:3] and a[3] != b[3]
    # The same chunk after another prefix is another key: a key names everything before it.
    assert prefix_keys(_text(1, "x") + _text(1, "y"))[1] != prefix_keys(_text(1, "z") + _text(1, "y"))[1]
    assert prefix_keys(list(range(64)))[:1] != prefix_keys("".join(map(chr, range(64))))[:1]
    assert len(prefix_keys(list(range(64)))) == 64 // (CHUNK // 4)


def test_match_counts_the_leading_chunks_each_worker_was_sent():
    index = PrefixIndex(CHUNK, max_chunks=100)
    conversation = _text(4, "turn1")
    index.record(index.keys(conversation), "gpu0")
    follow_up = index.keys(conversation + _text(2, "turn2"))
    assert index.match(follow_up, "gpu0") == 4
    assert index.match(follow_up, "gpu1") == 0
    assert index.match(index.keys(_text(4, "other")), "gpu0") == 0


def test_index_memory_is_bounded_and_evicts_least_recent_leaves_first():
    index = PrefixIndex(CHUNK, max_chunks=10)
    old, hot = index.keys(_text(6, "old")), index.keys(_text(6, "hot"))
    index.record(old, "gpu0")
    index.record(hot, "gpu0")  # 12 chunks for a bound of 10: two of `old` go
    assert index.size("gpu0") == 10 and index.evictions == 2
    # Leaves went first: what is left of `old` is still a prefix (its first 4 chunks).
    assert index.match(old, "gpu0") == 4 and index.match(hot, "gpu0") == 6
    for n in range(20):  # much more traffic: never above the bound, `hot` kept while it is used
        index.record(index.keys(_text(3, f"new{n}")), "gpu0")
        index.record(hot, "gpu0")
        assert index.size("gpu0") <= 10
    assert index.match(hot, "gpu0") == 6 and index.match(old, "gpu0") == 0
    index.drop("gpu0")
    assert index.size("gpu0") == 0 and index.match(hot, "gpu0") == 0


def test_index_refuses_a_useless_size():
    with pytest.raises(ValueError, match="`0`"):
        PrefixIndex(CHUNK, max_chunks=0)


# --- speed ---------------------------------------------------------------------------------
def test_speed_fit_recovers_the_step_time_model():
    fit = SpeedFit()
    c, a, b = 2e-3, 1 / 5000, 1e-3  # per step, per prompt token, per sequence in a step
    intervals = ((10, 800, 40), (50, 100, 200), (5, 3000, 10), (100, 0, 300), (40, 1200, 120), (20, 400, 60),
                 (30, 0, 240), (60, 200, 120))
    for steps, p, g in intervals:
        fit.observe(steps, p, g, c * steps + a * p + b * g)
    speed = fit.estimate()
    assert speed.prefill_tps == pytest.approx(5000, rel=0.05)
    assert speed.step_time(8) == pytest.approx(c + 8 * b, rel=0.05)
    assert speed.decode_tps(8) == pytest.approx(8 / (c + 8 * b), rel=0.05)
    assert speed.decode_tps(8) > 2 * speed.decode_tps(1)  # a batch shares the step's fixed cost
    assert speed.samples == len(intervals)


def test_speed_fit_skips_idle_intervals_and_fits_what_one_batch_size_can_tell():
    fit = SpeedFit()
    assert fit.estimate() is None
    fit.observe(10, 1000, 0, 0.0)  # an idle engine says nothing
    assert fit.estimate() is None
    for _ in range(3):  # decode only, always 4 sequences: the step time at 4 is all it can tell
        fit.observe(25, 0, 100, 0.5)
    speed = fit.estimate()
    assert speed.step_time(4) == pytest.approx(0.02)
    assert speed.decode_tps(4) == pytest.approx(200)
    assert speed.prefill_s > 0 and speed.step_s > 0 and speed.sequence_s > 0


def test_speed_fit_follows_a_slower_device_within_a_few_intervals():
    fit = SpeedFit(decay=0.5)
    c, a, b = 2e-3, 1e-4, 1e-3
    for steps, p, g in ((10, 500, 50), (50, 50, 100)) * 5:
        fit.observe(steps, p, g, c * steps + a * p + b * g)
    for steps, p, g in ((10, 500, 50), (50, 50, 100)) * 4:  # now three times slower
        fit.observe(steps, p, g, 3 * (c * steps + a * p + b * g))
    assert fit.estimate().decode_tps(8) == pytest.approx(8 / (c + 8 * b) / 3, rel=0.1)


def test_speed_fit_refuses_a_useless_decay():
    with pytest.raises(ValueError, match="`0`"):
        SpeedFit(decay=0)


def _metrics(busy: float, computed: float, skipped: float, generated: float, usage: float = 0.25) -> str:
    return (f"# HELP hetserve_worker_step_seconds Duration of one engine step\n"
            f"hetserve_worker_step_seconds_sum {busy}\n"
            f"hetserve_worker_step_seconds_count {generated / 4 + computed / 100}\n"
            f'hetserve_worker_prefill_tokens_total{{kind="computed"}} {computed}\n'
            f'hetserve_worker_prefill_tokens_total{{kind="skipped"}} {skipped}\n'
            f"hetserve_worker_generated_tokens_total {generated}\n"
            f"vllm:kv_cache_usage_perc {usage}\n")


def test_counters_read_the_workers_series():
    c = Counters.read(_metrics(1.5, 300, 100, 40))
    assert (c.busy_s, c.steps, c.computed, c.prompt, c.generated, c.kv_usage) == (1.5, 13, 300, 400, 40, 0.25)
    old = Counters.read("hetserve_worker_step_seconds_sum 2.0\nhetserve_worker_step_seconds_count 9\n"
                        "hetserve_worker_prompt_tokens_total 50.0\n"
                        "hetserve_worker_generated_tokens_total 7.0\n")
    assert (old.computed, old.prompt, old.kv_usage) == (50, 50, None)
    assert Counters.read("something_else 1\n") is None


def test_telemetry_learns_speed_and_characters_per_token_and_restarts_cleanly():
    t = Telemetry()
    t.observe("gpu0", 10, _metrics(0.0, 0, 0, 0))
    t.sent("gpu0", chars=6000, ids=0)
    t.observe("gpu0", 10, _metrics(1.0, 1500, 500, 100))  # 6000 characters were 2000 prompt tokens
    assert t.speed("gpu0") is not None and t.chars_per_token < 4.0
    for _ in range(10):
        t.sent("gpu0", chars=6000, ids=0)
        t.observe("gpu0", 10, _metrics(1.0 + 1, 3500, 500, 200))
        t.observe("gpu0", 10, _metrics(1.0, 1500, 500, 100))  # counters went down: a new start
    before = t.speed("gpu0").samples
    t.observe("gpu0", 11, _metrics(5.0, 9000, 0, 900))  # another pid: first sample, no interval
    assert t.speed("gpu0").samples == before
    assert t.kv_usage("gpu0") == 0.25 and t.tokens(3000) == round(3000 / t.chars_per_token)


# --- sessions ------------------------------------------------------------------------------
def test_a_session_sticks_to_its_worker():
    s = SessionAffinity(load_factor=1.5)
    ids = ["gpu0", "gpu1", "gpu2"]
    first = s.place("conv-1", {w: 0 for w in ids}, ids).worker
    for load in ({"gpu0": 1, "gpu1": 1, "gpu2": 1}, {"gpu0": 2, "gpu1": 2, "gpu2": 2}):
        assert s.place("conv-1", load, ids).worker == first
    # Sessions spread over the workers.
    assert len({s.place(f"conv-{n}", {w: 0 for w in ids}, ids).worker for n in range(30)}) == 3


def test_a_session_moves_when_its_worker_fails_and_stays_where_it_went():
    s = SessionAffinity()
    ids = ["gpu0", "gpu1", "gpu2"]
    home = s.place("conv", {w: 0 for w in ids}, ids).worker
    others = [w for w in ids if w != home]
    moved = s.place("conv", {w: 0 for w in others}, ids)  # its worker is gone (crashed, breaker open)
    assert moved.worker in others and moved.moved_from == home and moved.why == UNAVAILABLE
    assert s.moves == {(home, UNAVAILABLE): 1}
    # The old worker is back: the session stays on the worker that holds its cache now.
    again = s.place("conv", {w: 0 for w in ids}, ids)
    assert again.worker == moved.worker and again.moved_from is None and s.moves == {(home, UNAVAILABLE): 1}


def test_a_session_leaves_an_overloaded_worker():
    s = SessionAffinity(load_factor=1.5)
    ids = ["gpu0", "gpu1"]
    home = s.place("conv", {"gpu0": 0, "gpu1": 0}, ids).worker
    other = next(w for w in ids if w != home)
    # At light load a request more is noise: bound = ceil(1.5 * (1 + 1) / 2) + 1 = 3.
    assert s.place("conv", {home: 1, other: 0}, ids).worker == home
    # bound = ceil(1.5 * (7 + 1) / 2) + 1 = 7: the home worker at 6 would go to 7: it stays.
    assert s.place("conv", {home: 6, other: 1}, ids).worker == home
    # bound = ceil(1.5 * (9 + 1) / 2) + 1 = 9: at 9 it would go to 10: the session moves.
    placed = s.place("conv", {home: 9, other: 0}, ids)
    assert placed.worker == other and placed.why == OVERLOADED and s.moves == {(home, OVERLOADED): 1}


def test_sessions_are_remembered_up_to_a_bound():
    s = SessionAffinity(max_sessions=3)
    for n in range(10):
        s.place(f"conv-{n}", {"gpu0": 0, "gpu1": 0}, ["gpu0", "gpu1"])
    assert len(s) == 3


# --- score and pick --------------------------------------------------------------------------
def test_cache_aware_sends_a_prompt_to_the_worker_holding_its_prefix():
    ask = Ask(prompt_tokens=400, new_tokens=16)
    cands = [Candidate("gpu0", matched=0), Candidate("gpu1", matched=320), Candidate("gpu2", matched=64)]
    route = cache_aware(cands, ask, balance_abs=1024, balance_rel=1.5)
    assert (route.worker, route.reason, route.header) == ("gpu1", PREFIX, "prefix:320")


def test_a_prefix_every_worker_holds_decides_nothing():
    ask = Ask(prompt_tokens=400, new_tokens=16)
    cands = [Candidate("gpu0", matched=200, inflight_new=50), Candidate("gpu1", matched=200)]
    route = cache_aware(cands, ask, 1024, 1.5)
    assert (route.worker, route.header) == ("gpu1", LEAST_LOADED)


def test_faster_workers_are_preferred_and_carry_more_load():
    slow = dict(speed=Speed(step_s=0.0, prefill_s=3e-4, sequence_s=3e-3))  # 3e-3 s per token at any batch
    fast = dict(speed=Speed(step_s=0.0, prefill_s=1e-4, sequence_s=1e-3))
    ask = Ask(100, 32)
    assert cache_aware([Candidate("gpu0", **slow), Candidate("gpu1", **fast)], ask, 1024, 1.5).worker == "gpu1"
    # The fast worker with twice the tokens in flight is still done sooner ...
    busy_fast = Candidate("gpu1", inflight_new=64, **fast)
    assert cache_aware([Candidate("gpu0", **slow), busy_fast], ask, 1024, 1.5).worker == "gpu1"
    # ... but not with ten times as much.
    loaded_fast = Candidate("gpu1", inflight_new=320, **fast)
    assert cache_aware([Candidate("gpu0", **slow), loaded_fast], ask, 1024, 1.5).worker == "gpu0"


def test_imbalance_overrides_prefix_affinity():
    ask = Ask(prompt_tokens=400, new_tokens=16)
    holder = Candidate("gpu0", matched=384, inflight_prompt=500, inflight_new=1500, inflight_tokens=2400,
                       outstanding=30)
    idle = Candidate("gpu1")
    route = cache_aware([holder, idle], ask, balance_abs=1024, balance_rel=1.5)
    assert (route.worker, route.header) == ("gpu1", IMBALANCE)
    # Below the absolute threshold the prefix wins.
    assert cache_aware([holder, idle], ask, balance_abs=4096, balance_rel=1.5).header == "prefix:384"
    # Both loaded alike (relative threshold not reached): the prefix wins as well.
    both = Candidate("gpu1", inflight_prompt=400, inflight_new=1300, inflight_tokens=2000)
    assert cache_aware([holder, both], ask, balance_abs=1024, balance_rel=1.5).worker == "gpu0"


def test_imbalance_counts_load_relative_to_speed():
    ask = Ask(prompt_tokens=400, new_tokens=16)
    fast = Speed(step_s=0.0, prefill_s=1e-4, sequence_s=1e-3)
    slow = Speed(step_s=0.0, prefill_s=4e-4, sequence_s=4e-3)
    holder = Candidate("gpu0", matched=384, inflight_tokens=6000, speed=fast)
    # 6000 tokens on a worker four times as fast as the other weigh like 1500 there: no imbalance.
    others = [Candidate("gpu1", inflight_tokens=1000, speed=slow), Candidate("gpu2", inflight_tokens=1000, speed=slow)]
    assert cache_aware([holder, *others], ask, 1024, 1.5).header == "prefix:384"
    # The same tokens on a worker as slow as the others do tip it.
    same = Candidate("gpu0", matched=384, inflight_tokens=6000, speed=slow)
    assert cache_aware([same, *others], ask, 1024, 1.5).header == IMBALANCE


def test_a_hot_prefix_lets_every_worker_compete():
    """Guards `cands if hot else holders` in policy.cache_aware: without it a system prompt many
    clients send in parallel would pile every request onto the worker that saw it first."""
    ask = Ask(prompt_tokens=400, new_tokens=16)
    busy_holder = dict(matched=320, inflight_prompt=80, inflight_new=300, inflight_tokens=1300, outstanding=3)
    idle = Candidate("gpu1")
    # The prefix belongs to one conversation (nothing in flight shares it): it stays.
    assert cache_aware([Candidate("gpu0", **busy_holder), idle], ask, 4096, 1.5).header == "prefix:320"
    # Three requests in flight share it: a hot prefix, the idle worker takes a copy.
    hot = Candidate("gpu0", sharing=3, **busy_holder)
    route = cache_aware([hot, idle], ask, 4096, 1.5)
    assert (route.worker, route.header) == ("gpu1", LEAST_LOADED)
    # A hot prefix on an idle holder still goes there: it is also the cheapest.
    cheap = Candidate("gpu0", matched=320, sharing=3)
    assert cache_aware([cheap, Candidate("gpu1", inflight_tokens=10)], ask, 4096, 1.5).header == "prefix:320"


def test_a_prompt_open_to_all_skips_a_worker_beyond_the_bounded_load():
    """Guards the `bounded_load` filter in policy.cache_aware: without it the fastest worker
    takes every new conversation (and every request behind a hot prompt) until its cost
    catches up, far beyond its share of requests and of KV cache."""
    assert bounded_load([0, 0, 0], 1.5) == 2 and bounded_load([8, 4, 3], 1.5) == 9
    ask = Ask(prompt_tokens=100, new_tokens=16)
    very_fast = Speed(step_s=0.0, prefill_s=1e-6, sequence_s=1e-6)
    fast = Candidate("gpu2", outstanding=9, inflight_tokens=900, speed=very_fast)
    others = [Candidate("gpu0", outstanding=3), Candidate("gpu1", outstanding=3)]
    # 15 in flight with this one, 3 workers: at most ceil(1.5 * 16 / 3) + 1 = 9 each.
    assert cache_aware([fast, *others], ask, 4096, 1.5, load_factor=1.5).worker == "gpu0"
    assert cache_aware([fast, *others], ask, 4096, 1.5, load_factor=3.0).worker == "gpu2"
    # A prefix only it holds is a conversation's: it stays (imbalance, not the bound, moves it).
    holder = Candidate("gpu2", outstanding=9, inflight_tokens=900, speed=very_fast, matched=64)
    assert cache_aware([holder, *others], ask, 4096, 1.5, load_factor=1.5).header == "prefix:64"


def test_a_worker_short_of_free_kv_cache_costs_the_wait():
    ask = Ask(prompt_tokens=300, new_tokens=100)
    full = Candidate("gpu0", kv_free=50)
    assert cost_s(full, ask) > cost_s(Candidate("gpu0", kv_free=None), ask)
    assert cache_aware([full, Candidate("gpu1", kv_free=10_000)], ask, 1024, 1.5).worker == "gpu1"


def test_least_loaded_and_round_robin():
    cands = [Candidate("gpu0", outstanding=2), Candidate("gpu1", outstanding=1, picks=9),
             Candidate("gpu2", outstanding=1)]
    assert least_loaded(cands).worker == "gpu2"
    turns, last = [], None
    for _ in range(4):
        last = round_robin(cands, last).worker
        turns.append(last)
    assert turns == ["gpu0", "gpu1", "gpu2", "gpu0"]
    assert round_robin(cands[:2], "gpu1").worker == "gpu0"
    assert Route("gpu0", PREFIX, matched=12).header == "prefix:12"


# --- the router over the filter -------------------------------------------------------
def _handles(n=3):
    specs = build_worker_specs(parse_simulate(",".join(["sm_90"] * n)), RouterSettings(worker_command=("w",)),
                               Path("/tmp/run"), parent_pid=1, base_env={})
    handles = []
    for spec in specs:
        h = WorkerHandle(spec, state=WorkerState.READY, generation=1)
        h.client = object()
        h.info = CapabilityPayload(fp8={"convention": "native_e4m3"},
                                   capacity={"max_seq_len": 512, "kv_block_size": 16, "kv_blocks_total": 64})
        handles.append(h)
    return handles


def _send(router: Router, hs, body: dict, c: Constraints = Constraints(), capacity: int = 10):
    req = router.request(WorkerRequest.model_validate(body), c)
    d = choose(hs, c, capacity, router=router, req=req)
    assert d.kind == PICK, d.reason
    return router.begin(d.worker, d.route, req)


def test_turns_of_a_conversation_follow_their_prefix_and_load_is_counted_in_tokens():
    router, hs = Router(), _handles()
    history = _text(6, "conversation")
    first = _send(router, hs, {"inputs": history, "parameters": {"max_new_tokens": 20}})
    assert first.route.header == LEAST_LOADED and first.new_tokens == 20
    prompt = pytest.approx(len(history) / 4.0)
    assert router.inflight(first.worker.id) == (prompt, 20, pytest.approx(len(history) / 4.0 + 20))
    first.end()
    first.end()  # idempotent
    assert router.inflight(first.worker.id) == (0, 0, 0) and first.worker.outstanding == 0
    later = _send(router, hs, {"inputs": history + _text(2, "turn2"), "parameters": {"max_new_tokens": 20}})
    assert later.worker is first.worker and later.route.header == f"prefix:{round(6 * CHUNK / 4.0)}"
    # Only what the worker does not hold counts as prompt work.
    assert later.prompt_tokens == pytest.approx(2 * CHUNK / 4.0)


def test_broken_workers_stay_excluded_whatever_they_hold():
    router, hs = Router(), _handles()
    prompt = {"inputs": _text(6, "doc")}
    holder = _send(router, hs, prompt).worker
    holder.breaker = CircuitBreaker(BreakerPolicy(failures=1))
    holder.breaker.on_failure("answered 500")
    assert _send(router, hs, prompt).worker is not holder
    holder.breaker.reset()
    holder.state = WorkerState.UNHEALTHY  # found hung
    assert _send(router, hs, prompt).worker is not holder
    holder.state = WorkerState.READY
    assert _send(router, hs, prompt).worker is holder
    req = router.request(WorkerRequest.model_validate(prompt), Constraints())
    d = choose(hs, Constraints(), 10, exclude={holder.id: holder.generation},  # it failed this request
               router=router, req=req)
    assert d.worker is not holder


def test_pinned_requests_say_so_and_a_new_process_holds_no_prefix():
    router, hs = Router(), _handles()
    prompt = {"inputs": _text(4, "pinned")}
    c = parse_constraints({"x-hetserve-worker": "gpu2"})
    pinned = _send(router, hs, prompt, c)
    assert pinned.route.header == "pinned"
    assert router.index.size("gpu2") == 4
    pinned.end()  # while it ran, its prefix was hot there (shared by a request in flight)
    req = router.request(WorkerRequest.model_validate(prompt), Constraints())
    assert router.pick(hs, Constraints(), req)[1].header == "prefix:64"
    hs[2].generation += 1  # restarted: its cache is empty
    worker, route = router.pick(hs, Constraints(), req)
    assert router.index.size("gpu2") == 0 and route.header == LEAST_LOADED


def test_a_session_stays_on_its_worker_and_moves_when_that_worker_fails():
    router, hs = Router(), _handles()
    c = parse_constraints({"x-session-id": "chat-42"})
    home = _send(router, hs, {"inputs": "hello"}, c)
    assert home.route.header == "session"
    for n in range(3):  # turns of a conversation come one after the other, beside other traffic
        other = _send(router, hs, {"inputs": f"someone else {n}"})
        turn = _send(router, hs, {"inputs": f"turn {n}"}, c)
        assert turn.worker is home.worker
        turn.end()
        other.end()
    home.worker.state = WorkerState.RESTARTING  # it crashed
    moved = _send(router, hs, {"inputs": "turn 4"}, c)
    assert moved.worker is not home.worker and moved.route.header == "session"
    assert router.sessions.moves == {(home.worker.id, UNAVAILABLE): 1}
    home.worker.state = WorkerState.READY
    assert _send(router, hs, {"inputs": "turn 5"}, c).worker is moved.worker


def test_a_request_too_long_for_a_workers_kv_cache_goes_to_one_that_holds_it():
    router, hs = Router(), _handles()
    hs[0].info.capacity["max_seq_len"] = 128
    hs[1].info.capacity["max_seq_len"] = 128
    def long_prompt(n):  # about 450 tokens, no prefix shared
        return {"inputs": f"{n:03d}" + "x" * 1600, "parameters": {"max_new_tokens": 50}}

    assert {_send(router, hs, long_prompt(n)).worker.id for n in range(4)} == {"gpu2"}
    hs[2].info.capacity["max_seq_len"] = 128  # none could: the workers have the last word
    assert {_send(router, hs, long_prompt(n)).worker.id for n in range(4, 10)} >= {"gpu0", "gpu1"}


def test_free_kv_comes_from_the_latest_probe_else_the_metrics():
    router, hs = Router(), _handles()
    h = hs[0]  # 64 blocks of 16 tokens
    assert router.snapshot(h)["kv_free_tokens"] is None  # nothing reported yet
    router.observe(h, "hetserve_worker_step_seconds_sum 0\nhetserve_worker_step_seconds_count 0\n"
                      "hetserve_worker_generated_tokens_total 0\nvllm:kv_cache_usage_perc 0.75\n")
    assert router.snapshot(h)["kv_free_tokens"] == 16 * 16
    h.live_capacity = {"kv_blocks_free": 10}  # the last /health probe said so
    assert router.snapshot(h)["kv_free_tokens"] == 10 * 16


def test_the_policy_never_sees_a_worker_the_filter_refused():
    router, hs = Router(), _handles(1)
    hs[0].breaker = CircuitBreaker(BreakerPolicy(failures=1))
    hs[0].breaker.on_failure("answered 500")
    req = router.request(WorkerRequest(inputs="x"), Constraints())
    assert choose(hs, Constraints(), 10, router=router, req=req).kind == WAIT


# --- configuration -----------------------------------------------------------------------------
def test_routing_flags_reach_the_settings_and_bad_ones_are_refused():
    args = build_parser().parse_args(["serve", "--routing", "least-loaded", "--routing-balance-abs", "64",
                                      "--routing-balance-rel", "2", "--routing-tree-size", "100"])
    config = RouterSettings.from_args(args).routing
    assert (config.policy, config.balance_abs, config.balance_rel, config.tree_size) == ("least-loaded", 64, 2.0, 100)
    assert RouterSettings.from_args(build_parser().parse_args(["serve"])).routing == RoutingConfig()
    for flag, value, needle in (("--routing-balance-rel", "0.5", "`--routing-balance-rel 0.5` must be >= 1.0"),
                                ("--routing-tree-size", "0", "`--routing-tree-size 0` must be >= 1"),
                                ("--routing-load-factor", "0.9", "must be >= 1.0")):
        with pytest.raises(UsageError, match=needle):
            routing_from_args(build_parser().parse_args(["serve", flag, value]))
    with pytest.raises(UsageError, match="Unknown routing policy `random`. Accepted: cache-aware"):
        RoutingConfig(policy="random")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--routing", "random"])


# --- the slow-down knob ----------------------------------------------------------------------------
def test_slowdown_factor_per_worker_and_bad_values_named():
    assert slowdown_factor("", "gpu0") == 1.0
    assert slowdown_factor("3", "gpu1") == 3.0
    assert slowdown_factor("gpu0=3, gpu2=1.5", "gpu2") == 1.5
    assert slowdown_factor("gpu0=3", "gpu1") == 1.0
    assert slowdown_factor("2,gpu0=4", "gpu0") == 4.0
    for bad in ("gpu0=fast", "gpu0=0.5", "gpu0=inf", "gpu0=nan"):
        with pytest.raises(ValueError, match="Invalid HETSERVE_SLOWDOWN factor .* Accepted: a number >= 1"):
            slowdown_factor(bad, "gpu0")


def test_slowdown_makes_each_forward_take_longer():
    def step(x):  # 20 ms of this thread's CPU: the knob scales CPU time when torch runs on one thread
        start = time.thread_time()
        while time.thread_time() - start < 0.02:
            pass
        return x + 1

    model = SimpleNamespace(step=step)
    assert not apply_slowdown(model, device_slowdown("gpu0=3", "gpu1", True)).slowed and model.step is step
    assert apply_slowdown(model, device_slowdown("gpu0=3", "gpu0", True)).decode == 3.0
    t0 = time.perf_counter()
    assert model.step(1) == 2
    assert time.perf_counter() - t0 >= 0.055
