"""The router's failure handling as plain code: the circuit breaker's states, the health probe's
verdicts, the filter skipping open breakers, breaking a hung worker's connections, the flags."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.cli import build_parser
from server.config.settings import RouterSettings
from server.errors import UsageError
from server.fleet.breaker import BreakerPolicy, BreakerState, CircuitBreaker
from server.fleet.probe import Act, Probe, Tally, judge
from server.fleet.uds_http import UnixHTTPPool, WorkerConnectionLost
from server.routing.filter import WAIT, Constraints
from tests.routing_helpers import PICK, choose
from tests.test_router_units import _handles


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_one_probe_decides():
    clock = Clock()
    b = CircuitBreaker(BreakerPolicy(failures=3, cooldown_s=10), clock)
    b.on_failure("answered 500")
    b.on_failure("answered 500")
    b.on_success()  # a success in between resets the count
    for _ in range(2):
        b.on_failure("answered 500")
    assert b.state == BreakerState.CLOSED and b.admits()
    b.on_failure("connection lost")
    assert b.state == BreakerState.OPEN and not b.admits() and b.retry_in_s() == 10
    assert b.snapshot() == {"state": "open", "consecutive_failures": 3, "times_opened": 1,
                            "last_failure": "connection lost", "retry_in_s": 10.0}
    clock.now += 9.9
    assert not b.admits()
    clock.now += 0.1
    assert b.state == BreakerState.HALF_OPEN and b.admits()
    b.on_dispatch()  # the probe
    assert not b.admits()  # one probe at a time
    b.on_failure("answered 503")
    assert b.state == BreakerState.OPEN and b.times_opened == 2 and b.retry_in_s() == 10
    clock.now += 10
    b.on_dispatch()
    b.on_neutral()  # the probe's client left (or a 429): another probe may go
    assert b.admits()
    b.on_dispatch()
    b.on_success()
    assert b.state == BreakerState.CLOSED and b.consecutive_failures == 0
    assert b.snapshot() == {"state": "closed", "consecutive_failures": 0, "times_opened": 2}


def test_outcomes_of_an_earlier_process_do_not_reach_the_new_ones_breaker():
    """Guards the generation check in `WorkerHandle.request_outcome`: streams lost by a killed
    process would otherwise open the breaker of its restarted successor."""
    h = _handles("sm_90")[0]
    h.breaker = CircuitBreaker(BreakerPolicy(failures=1))
    h.request_outcome(h.generation - 1, False, "connection lost")
    assert h.breaker.state == BreakerState.CLOSED
    h.request_outcome(h.generation, False, "connection lost")
    assert h.breaker.state == BreakerState.OPEN


def test_the_filter_skips_open_breakers_and_waits_when_all_are_open():
    hs = _handles()
    clock = Clock()
    for h in hs:
        h.breaker = CircuitBreaker(BreakerPolicy(failures=1, cooldown_s=5), clock)
    hs[0].breaker.on_failure("answered 500")
    for _ in range(4):
        d = choose(hs, Constraints(), capacity=10)
        assert d.kind == PICK and d.worker is not hs[0]
        d.worker.picks += 1
    hs[1].breaker.on_failure("answered 500")
    hs[2].breaker.on_failure("answered 500")
    d = choose(hs, Constraints(), capacity=10)
    assert d.kind == WAIT and "circuit breaker" in d.reason and "gpu0 (retry in 5.0s)" in d.reason
    clock.now += 5  # cool-downs over: each may take one probe
    d = choose(hs, Constraints(worker="gpu1"), capacity=10)
    assert d.kind == PICK and d.worker is hs[1]
    hs[1].breaker.on_dispatch()
    assert choose(hs, Constraints(worker="gpu1"), capacity=10).kind == WAIT


@pytest.mark.parametrize(("code", "body", "kind", "why"), [
    (200, {"status": "ready", "engine": {"pending": True, "last_step_age_s": 0.2}}, Probe.OK, "ok"),
    (200, {"status": "ready", "engine": {"pending": False, "last_step_age_s": 99}}, Probe.OK, "ok"),
    (200, {"status": "ready", "engine": {"pending": True, "last_step_age_s": 31.5}}, Probe.HUNG,
     "engine stalled: work pending and no step for 31.5s (stall timeout 30s)"),
    (503, {"status": "draining"}, Probe.FAILING, "/health answered 503 draining"),
    (200, {"status": "ready"}, Probe.OK, "ok"),  # a worker that does not report liveness
    (200, {"engine": "garbage"}, Probe.OK, "ok"),
])
def test_probe_verdicts(code, body, kind, why):
    verdict = judge(code, body, stall_timeout_s=30)
    assert (verdict.kind, verdict.why) == (kind, why)


@pytest.mark.parametrize(("age", "computing", "kind"), [
    (45.0, 0.9, Probe.SLOW),  # a long step on a loaded host: left running
    (45.0, 0.01, Probe.HUNG),  # no CPU used: a deadlocked engine
    (125.0, 0.9, Probe.HUNG),  # computing, but past COMPUTING_STALL_FACTOR stall timeouts
    (45.0, None, Probe.HUNG),  # CPU unknown: the stall timeout alone decides
])
def test_a_stall_while_the_worker_computes_is_slow_not_hung(age, computing, kind):
    """Guards the `computing >= STALL_CPU_SHARE` branch of `judge` in server/fleet/probe.py: a step
    longer than the stall timeout on a host loaded by other work was taken for a hung engine, its
    worker restarted and its requests counted as witnesses of a death."""
    body = {"status": "ready", "engine": {"pending": True, "last_step_age_s": age}}
    verdict = judge(200, body, stall_timeout_s=30, computing=computing)
    assert verdict.kind == kind, verdict.why
    act, _ = Tally(3, 60).count(verdict, urgent=False, ready=True)
    assert (act == Act.REPLACE) == (kind == Probe.HUNG)


def test_abort_fails_a_read_blocked_on_a_silent_worker_at_once(tmp_path):
    """Guards `UnixHTTPPool.abort` (closing connections in use): a frozen worker's socket
    accepts and never answers, so without it the read waits forever."""

    async def main():
        path = str(tmp_path / "w.sock")
        accepted = []

        async def silent(reader, writer):
            accepted.append(writer)
            await asyncio.sleep(3600)

        server = await asyncio.start_unix_server(silent, path)
        pool = UnixHTTPPool(path)
        pending = asyncio.ensure_future(pool.request("POST", "/generate_stream", b"{}"))
        while not accepted:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert not pending.done()
        started = time.monotonic()
        pool.abort()
        with pytest.raises(WorkerConnectionLost):
            await asyncio.wait_for(pending, 2)
        assert time.monotonic() - started < 0.5
        server.close()
        for w in accepted:
            w.close()

    asyncio.run(main())


def test_failure_flags_reach_the_settings_and_bad_values_are_named():
    parse = build_parser().parse_args
    args = parse(["serve", "--migration-limit", "0", "--stall-timeout", "12.5", "--health-timeout", "2",
                  "--breaker-failures", "4", "--breaker-cooldown", "7"])
    s = RouterSettings.from_args(args)
    assert (s.migration_limit, s.stall_timeout_s, s.health_timeout_s, s.breaker_failures, s.breaker_cooldown_s) == \
           (0, 12.5, 2.0, 4, 7.0)
    d = RouterSettings.from_args(parse(["serve"]))
    assert (d.migration_limit, d.stall_timeout_s, d.breaker_failures, d.breaker_cooldown_s) == (3, 30.0, 5, 10.0)
    for flag, value, needle in (("--migration-limit", "-1", "`--migration-limit -1` must be >= 0"),
                                ("--stall-timeout", "0", "`--stall-timeout 0.0` must be > 0"),
                                ("--breaker-failures", "0", "`--breaker-failures 0` must be >= 1")):
        with pytest.raises(UsageError, match=needle):
            RouterSettings.from_args(parse(["serve", flag, value]))
