"""The canary's comparison and verdicts (server/canary/compare.py), its flags, and its rule of
never taking a batch slot a user request could use (server/canary/monitor.py)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest

from server.canary.compare import Numerics, Position, Scored, compare, consensus, expectation, parse_scores
from server.canary.monitor import CanaryBusy, CanaryMonitor
from server.cli import build_parser
from server.config.settings import CANARY_MIN_AGREEMENT, RouterSettings
from server.errors import UsageError
from server.fleet.canary_record import HEALTHY, SUSPECT
from workers.contract import CapabilityPayload


def scored(*rows) -> Scored:
    """`rows`: (token, logprob, ((alt, logprob), ...))."""
    return Scored(tuple(Position(t, lp, tuple(top)) for t, lp, top in rows))


REF = [scored((5, -0.1, ((5, -0.1), (7, -2.0))), (9, -0.5, ((9, -0.5), (3, -1.5))))]


def test_compare_counts_best_tokens_and_the_largest_logprob_difference():
    same = compare(REF, REF)
    assert (same.agreement, same.max_logprob_diff, same.positions) == (1.0, 0.0, 2)
    flipped = [scored((5, -0.3, ((5, -0.3), (7, -1.0))), (9, -1.4, ((3, -0.2), (9, -1.4))))]
    c = compare(flipped, REF)
    assert c.agreement == 0.5 and c.positions == 2
    assert math.isclose(c.max_logprob_diff, 1.3)  # token 3: -0.2 against -1.5
    with pytest.raises(ValueError, match="not the same sequence"):
        compare([scored((5, -0.1, ()))], REF)


def test_parse_scores_skips_the_first_prompt_token():
    body = {"details": {"prefill": [{"id": 1, "logprob": None}, {"id": 5, "logprob": -0.1,
                                                                  "top_tokens": [{"id": 5, "logprob": -0.1}]}]}}
    assert parse_scores(body) == scored((5, -0.1, ((5, -0.1),)))
    with pytest.raises(ValueError, match="no scored positions"):
        parse_scores({"details": {"prefill": [{"id": 1, "logprob": None}]}})


def test_consensus_takes_the_majority_then_device_order():
    a, b = (1, 2, 3), (1, 2, 4)
    assert consensus([[a, a], [b, a], [a, b]]) == [0, 0]
    assert consensus([[b], [a]]) == [0]  # a tie: the first worker


def _numerics(deterministic: bool, fp8: str = "native_e4m3") -> Numerics:
    info = CapabilityPayload(model={"dtype": "bfloat16"}, device={"type": "cuda"}, fp8={"convention": fp8},
                             deterministic={"enabled": deterministic, "row_tile": 32, "kv_split": 64})
    return Numerics.of(info)


def test_exact_only_where_both_run_deterministic_with_the_same_numerics():
    det, other_fp8, default = _numerics(True), _numerics(True, "emulated"), _numerics(False)
    exact = expectation(det, det, 0.9)
    assert exact.exact
    assert exact.judge(compare(REF, REF))[0] == HEALTHY
    close = [scored((5, -0.1000001, ((5, -0.1000001), (7, -2.0))), (9, -0.5, ((9, -0.5), (3, -1.5))))]
    verdict, reason = exact.judge(compare(close, REF))
    assert verdict == SUSPECT and "although both run deterministic" in reason
    for worker, ref in ((det, other_fp8), (default, default), (det, default)):
        e = expectation(worker, ref, 0.9)
        assert not e.exact and e.judge(compare(close, REF))[0] == HEALTHY
        half = [scored((5, -0.1, ((5, -0.1),)), (9, -1.4, ((3, -0.2),)))]
        assert e.judge(compare(half, REF)) == (SUSPECT, "agreement 0.5000 < 0.9 over 2 positions")


def test_canary_flags_reach_the_settings_and_bad_values_are_named():
    parse = build_parser().parse_args
    d = RouterSettings.from_args(parse(["serve"]))
    assert (d.deterministic, d.canary_interval_s, d.canary_min_agreement, d.canary_action) == \
           (False, 300.0, CANARY_MIN_AGREEMENT, "mark")
    s = RouterSettings.from_args(parse(["serve", "--deterministic", "--canary-interval", "0",
                                        "--canary-min-agreement", "0.95", "--canary-action", "drain"]))
    assert (s.deterministic, s.canary_interval_s, s.canary_min_agreement, s.canary_action) == (True, 0.0, 0.95, "drain")
    for flag, value, needle in (("--canary-interval", "-1", "`--canary-interval -1.0` must be >= 0"),
                                ("--canary-interval", "nan", "`--canary-interval nan` must be >= 0"),
                                ("--canary-min-agreement", "1.5", "`--canary-min-agreement 1.5` must be a fraction")):
        with pytest.raises(UsageError, match=needle):
            RouterSettings.from_args(parse(["serve", flag, value]))
    with pytest.raises(SystemExit):
        parse(["serve", "--canary-action", "reboot"])


def test_the_canary_waits_for_a_free_batch_slot(monkeypatch):
    """A worker with `--max-batch` requests in flight gets no canary request until one ends."""
    monkeypatch.setattr("server.canary.monitor.SLOT_WAIT_S", 0.3)
    settings = RouterSettings(max_batch=2)
    monitor = CanaryMonitor(SimpleNamespace(workers={}), settings)
    h = SimpleNamespace(outstanding=2)

    async def scenario():
        waiting = asyncio.create_task(monitor._free_slot(h))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # both slots are users'
        h.outstanding = 1
        await asyncio.wait_for(waiting, 1)
        h.outstanding = 2
        with pytest.raises(CanaryBusy, match="no free batch slot"):
            await monitor._free_slot(h)

    asyncio.run(scenario())


class _Supervisor:
    """Records what the canary asks of the supervisor."""

    def __init__(self):
        self.workers, self.calls = {}, []

    def hold(self, h, why, restart=False):
        h.canary_hold = why
        self.calls.append(("restart" if restart else "hold", why))

    def release(self, h):
        h.canary_hold = None
        self.calls.append(("release", ""))


def test_drain_restarts_a_suspect_twice_then_holds_it_until_it_passes():
    """Guards `MAX_CANARY_RESTARTS` in `CanaryMonitor._drain` and the release in `_conclude`."""
    from server.canary.compare import Reference
    from server.canary.monitor import MAX_CANARY_RESTARTS

    sup = _Supervisor()
    monitor = CanaryMonitor(sup, RouterSettings(canary_action="drain"))
    info = CapabilityPayload(model={"dtype": "bfloat16"}, device={"type": "cuda"}, fp8={"convention": "emulated"})
    monitor.references["m"] = Reference("m", ((1, 5, 9),), tuple(REF), "gpu0", Numerics.of(info), 0.0)
    h = SimpleNamespace(id="gpu1", generation=1, info=info, canary=None, canary_hold=None, model="m")
    wrong = [scored((7, -0.1, ((7, -0.1),)), (3, -0.5, ((3, -0.5),)))]
    for _ in range(MAX_CANARY_RESTARTS + 2):
        monitor._conclude(h, tuple(wrong))
    kinds = [kind for kind, _ in sup.calls]
    assert kinds == ["restart"] * MAX_CANARY_RESTARTS + ["hold", "hold"]
    assert h.canary.suspect and "after 2 restarts" in h.canary_hold
    monitor._conclude(h, tuple(REF))
    assert sup.calls[-1][0] == "release" and h.canary_hold is None and not h.canary.suspect
    monitor._conclude(h, tuple(wrong))  # healthy in between: the restarts count again
    assert sup.calls[-1][0] == "restart"
    marking = CanaryMonitor(_Supervisor(), RouterSettings(canary_action="mark"))
    marking.references = monitor.references
    marking._conclude(h2 := SimpleNamespace(id="gpu2", generation=1, info=info, canary=None, canary_hold=None,
                                            model="m"), tuple(wrong))
    assert h2.canary.suspect and h2.canary_hold is None and marking.supervisor.calls == []


def test_a_models_only_worker_is_not_held_for_the_first_check():
    """Guards `serving[_model(h)] > 1` in `CanaryMonitor.run`: a model's only worker was held out of
    rotation until the first round recorded its own reference, so a single-worker server answered
    its first request only after that round (which waits on a background compile's held steps)."""

    class Settled(Exception):
        pass

    sup = _Supervisor()
    sup.workers = {wid: SimpleNamespace(id=wid, model=model, canary_hold=None)
                   for wid, model in (("gpu0", "a"), ("gpu1", "b"), ("gpu2", "b"))}

    async def wait_settled(timeout):
        raise Settled

    sup.wait_settled = wait_settled
    with pytest.raises(Settled):
        asyncio.run(CanaryMonitor(sup, RouterSettings(canary_interval_s=60)).run())
    assert {wid: h.canary_hold is not None for wid, h in sup.workers.items()} == {
        "gpu0": False, "gpu1": True, "gpu2": True}
