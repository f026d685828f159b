"""Disaggregated prefill from measured speeds (server/routing/split.py): the roles `auto` takes
from the router's measured step-time models, and where one long prompt is prefilled, how much of
it, given the prefill work queued on each worker."""

from __future__ import annotations

import pytest

from server.routing.speed import Speed
from server.routing.split import (
    HANDOFF_S,
    LOCAL,
    MIN_SAMPLES,
    PART,
    SPLIT_OFF,
    SPLIT_ON,
    SPLIT_UNEXPECTED,
    WHOLE,
    Side,
    measured_roles,
    plan,
)


def _speed(prefill_s: float, sequence_s: float, samples: int = MIN_SAMPLES) -> Speed:
    return Speed(step_s=0.0, prefill_s=prefill_s, sequence_s=sequence_s, samples=samples)


FAST = _speed(1e-4, 1e-3)  # compute and bandwidth of the best card
SLOW_COMPUTE = _speed(4e-4, 1.5e-3)  # prefill 4x slower, decode 1.5x: advantage 2.67


def test_a_card_faster_at_prefill_than_at_decode_prefills_and_the_others_decode():
    m = measured_roles({"gpu0": FAST, "gpu1": SLOW_COMPUTE, "gpu2": SLOW_COMPUTE}, active=False)
    assert m.prefill == "gpu0" and m.advantage == pytest.approx(4 / 1.5)
    assert "gpu1, gpu2 decode" in m.reason and "comparative advantage 2.67" in m.reason


@pytest.mark.parametrize("other", [FAST, _speed(2e-4, 2e-3), _speed(4e-4, 2.9e-3)],
                         ids=["identical", "slower at both alike", "advantage 1.38"])
def test_identical_or_uniformly_slower_devices_keep_todays_routing(other):
    m = measured_roles({"gpu0": FAST, "gpu1": other}, active=False)
    assert m.prefill is None and m.reason.startswith("auto: not disaggregated") and m.advantage < SPLIT_ON
    assert measured_roles({"gpu0": FAST, "gpu1": other}, active=False, expected=False).advantage < SPLIT_UNEXPECTED


def test_the_roles_wait_for_every_worker_to_be_measured():
    """Guards the `samples < MIN_SAMPLES` check: a worker with one interval of traffic has a
    first guess, not a speed, and no role follows from it."""
    assert measured_roles({"gpu0": FAST, "gpu1": None}, active=False) is None
    assert measured_roles({"gpu0": FAST, "gpu1": _speed(4e-4, 1.5e-3, samples=MIN_SAMPLES - 1)}, False) is None
    assert measured_roles({"gpu0": FAST}, active=False) is None


def test_devices_alike_on_paper_need_a_large_measured_difference_to_split():
    """Guards `SPLIT_UNEXPECTED`: where the cards say the devices are alike, an advantage of 2.7
    (as a shared host's contention can fake between identical workers) does not split them, 5 does."""
    speeds = {"gpu0": FAST, "gpu1": SLOW_COMPUTE}
    assert measured_roles(speeds, active=False, expected=True).prefill == "gpu0"
    assert measured_roles(speeds, active=False, expected=False).prefill is None
    assert measured_roles({"gpu0": FAST, "gpu1": _speed(1e-3, 2e-3)}, False, expected=False).prefill == "gpu0"


def test_the_split_holds_between_the_two_thresholds():
    """Guards `SPLIT_OFF if active`: an advantage that wavers just under the start threshold does
    not flap the roles off and on."""
    between = _speed(1e-4 * (SPLIT_ON + SPLIT_OFF) / 2, 1e-3)  # decode alike, prefill 1.8x slower
    assert measured_roles({"gpu0": FAST, "gpu1": between}, active=False).prefill is None
    assert measured_roles({"gpu0": FAST, "gpu1": between}, active=True).prefill == "gpu0"


def _sides(fast_queued: float = 0.0, slow_queued: float = 0.0) -> list[Side]:
    return [Side("gpu0", True, True, 1e-4, fast_queued), Side("gpu1", False, True, 4e-4, slow_queued),
            Side("gpu2", False, True, 4e-4, slow_queued)]


def test_an_idle_fast_card_prefills_the_whole_prompt():
    s = plan(_sides(), 1000, 16)
    assert (s.kind, s.prefill, s.tokens) == (WHOLE, "gpu0", 1000)
    assert s.ttft_s == pytest.approx(0.1 + HANDOFF_S)
    assert "first token in 120 ms on gpu0 against 400 ms on gpu1" in s.reason


def test_a_swamped_prefill_card_leaves_the_prompt_where_it_decodes():
    """Guards the `MIN_GAIN` comparison of local against whole: 2 s of prefill queued on the fast
    card against 0.4 s to compute the prompt on an idle slow one."""
    s = plan(_sides(fast_queued=2.0), 1000, 16)
    assert (s.kind, s.decode) == (LOCAL, "gpu1")
    assert s.reason.startswith("first token sooner here: 400 ms on gpu1 against 2120 ms on gpu0")


def test_a_small_saving_keeps_the_roles():
    """Local is only 5% sooner than the handoff: the prompt still goes to the prefill worker."""
    s = plan(_sides(fast_queued=0.3, slow_queued=0.0), 1000, 16)  # whole 0.42 s, local 0.40 s
    assert s.kind == WHOLE


def _cronus(decode_queued: float) -> list[Side]:
    """A low-end card that may prefill (4x slower at it) beside a busy high-end one that decodes."""
    return [Side("gpu1", True, False, 4e-4, 0.0), Side("gpu0", False, True, 1e-4, decode_queued)]


def test_a_slower_prefill_card_computes_the_part_it_can_while_the_fast_one_is_busy():
    """Cronus's split: gpu0 is busy for 0.3 s, in which gpu1 computes 0.3 / 4e-4 = 750 tokens, cut
    to whole 16-token blocks (736); gpu0 then computes the other 264: 0.35 s to the first token
    against 0.40 s on gpu0 alone and 0.42 s on gpu1 alone."""
    s = plan(_cronus(0.3), 1000, 16)
    assert (s.kind, s.prefill, s.decode, s.tokens) == (PART, "gpu1", "gpu0", 736)
    assert s.ttft_s == pytest.approx(0.3 + 264 * 1e-4 + HANDOFF_S)
    assert s.reason.startswith("736 of 1000 prompt tokens on gpu1 while gpu0 is busy, the rest on gpu0")


@pytest.mark.parametrize(("queued", "kind", "tokens"), [(0.0, LOCAL, 0), (0.005, LOCAL, 0), (0.1, LOCAL, 0),
                                                        (0.25, PART, 624), (0.34, PART, 848), (10.0, WHOLE, 1000)])
def test_how_much_the_slow_card_takes_follows_the_fast_cards_queue(queued, kind, tokens):
    """Free or nearly free, the fast card computes the prompt (a part would save less than
    `MIN_GAIN`); busy, the slow card takes whole blocks of it, more the longer the queue; swamped,
    the slow card computes it all and samples the first token."""
    s = plan(_cronus(queued), 1000, 16)
    assert (s.kind, s.tokens) == (kind, tokens), s.reason
    assert s.tokens % 16 == 0 or s.kind == WHOLE


def test_a_faster_prefill_card_never_takes_only_a_part():
    """Where p is faster at prefill than d, T(k) only falls with k: the whole prompt goes to p."""
    sides = [Side("gpu0", True, False, 1e-4, 0.0), Side("gpu1", False, True, 4e-4, 5.0)]
    assert plan(sides, 1000, 16).kind == WHOLE


def _moments(steps) -> dict[str, float]:
    """Cumulative step moments as a worker sums them (workers/engine/metrics.py `on_step`)."""
    from workers.engine.metrics import STEP_MOMENTS

    m = dict.fromkeys(STEP_MOMENTS, 0.0)
    for p, b, y in steps:
        for name, v in (("n", 1), ("p", p), ("b", b), ("pp", p * p), ("bb", b * b), ("pb", p * b), ("y", y),
                        ("py", p * y), ("by", b * y), ("np", 1 if p else 0)):
            m[name] += v
    return m


def test_the_phase_fit_recovers_each_phases_cost_from_the_steps_a_worker_sums():
    """A worker's steps (decode-only at batch sizes 1-8, and prompt chunks beside decode rows)
    at c = 2 ms, a = 0.1 ms per prompt token, b = 0.5 ms per sequence: the fit over the moments'
    growth between two samples gives them back, which the interval fit cannot separate."""
    import random

    from server.routing.phases import PhaseFit

    rng = random.Random(0)
    steps = []
    for _ in range(200):
        p = rng.choice([0, 0, 0, 64, 256])
        b = rng.randint(1, 8)
        steps.append((p, b, 2e-3 + 1e-4 * p + 5e-4 * b))
    fit = PhaseFit()
    fit.observe(_moments(steps[:1]), restarted=False)
    assert fit.estimate() is None  # the first sample only sets the baseline
    fit.observe(_moments(steps), restarted=False)
    got = fit.estimate()
    assert (got.step_s, got.prefill_s, got.sequence_s) == pytest.approx((2e-3, 1e-4, 5e-4), rel=1e-6)
    fit.observe(_moments(steps[:10]), restarted=True)  # a new process: its counters start again
    assert fit.estimate() == got


def test_a_worker_exports_its_step_moments_and_the_router_reads_them():
    """Guards `step_moments` in `WorkerMetrics.on_step`: the router's reader finds the sums in the
    worker's own `/metrics` text."""
    from types import SimpleNamespace

    from server.routing.phases import read_moments
    from workers.engine.metrics import WorkerMetrics

    metrics = WorkerMetrics()
    for p, b, y in ((0, 3, 0.004), (128, 2, 0.02)):
        metrics.on_step(y, b, SimpleNamespace(num_prefill_tokens=p, num_queried_tokens=0, num_cached_tokens=0,
                                              preempted=()), b)
    got = read_moments(metrics.render().decode())
    assert got == pytest.approx(_moments([(0, 3, 0.004), (128, 2, 0.02)]))


@pytest.mark.parametrize(("new_tokens", "stays"), [(4, True), (20, True), (21, False), (64, False)])
def test_a_short_answer_is_decoded_where_it_was_prefilled(new_tokens, stays):
    """Guards `new_tokens * sequence_s <= HANDOFF_S`: 1 ms a sequence adds to each decode step on
    gpu0, so up to 20 new tokens cost it less than moving the prompt's blocks."""
    sides = [Side("gpu0", True, True, 1e-4, 0.0, 1e-3), Side("gpu1", False, True, 4e-4, 0.0, 2e-3)]
    s = plan(sides, 1000, 16, new_tokens)
    assert s.kind == WHOLE and s.stays == stays
    assert ("less than a handoff" in s.reason) == stays
    assert not plan([Side("gpu0", True, False, 1e-4, 0.0, 1e-3), sides[1]], 1000, 16, 4).stays  # gpu0 only prefills


def test_a_measured_split_applies_only_once_it_has_held_for_a_while(monkeypatch):
    """Guards `Disaggregation._held` (server/dispatch/handoff.py): under `auto`, a split the cards
    did not foresee, measured from a few noisy intervals of a shared host, changes no role until the
    same prefill worker has been measured for `SPLIT_AFTER_S`; a split that stops being measured is
    undone at once, and the measured figures replace the reason as soon as they exist."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    import server.dispatch.handoff as handoff
    from server.routing.roles import BOTH, DECODE, Roles

    clock = [1000.0]
    monkeypatch.setattr(handoff.time, "monotonic", lambda: clock[0])
    speeds = {"gpu0": FAST, "gpu1": _speed(1e-3, 1.5e-3)}  # advantage 6.67, past even SPLIT_UNEXPECTED
    router = SimpleNamespace(telemetry=SimpleNamespace(phases=lambda w: speeds[w]))
    workers = [SimpleNamespace(id=w, routable=True) for w in speeds]
    d = handoff.Disaggregation(Roles({}, "auto: the cards see no difference"), 16, 8, CollectorRegistry(),
                               measured=True)
    assert not d.refresh(router, workers).active
    clock[0] += handoff.SPLIT_AFTER_S - 1
    assert not d.refresh(router, workers).active
    clock[0] += 1
    roles = d.refresh(router, workers)
    assert roles.role("gpu0") == BOTH and roles.role("gpu1") == DECODE and "measured" in roles.reason
    speeds["gpu1"] = FAST  # the difference is gone: no split, at once
    roles = d.refresh(router, workers)
    assert not roles.active and "not disaggregated: measured" in roles.reason
    speeds["gpu1"] = _speed(1e-3, 1.5e-3)  # back again: it waits its full time once more
    clock[0] += 1
    assert not d.refresh(router, workers).active
    clock[0] += handoff.SPLIT_AFTER_S
    assert d.refresh(router, workers).active
