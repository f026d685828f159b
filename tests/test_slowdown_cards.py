"""A simulated card slowed like the real one: prefill and decode factors apart
(workers/contract/slowdown.py), the catalog's published speeds (workers/contract/catalog.py), and
a step's factor weighted by its phases' tokens (workers/device/slowdown.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from server.fleet.pipelines import device_speed
from server.fleet.spec import _slowdown_fields
from workers.contract.catalog import card
from workers.contract.config import WorkerConfig
from workers.contract.slowdown import Slowdown, device_slowdown, slowdown_of
from workers.contract.topology import parse_simulate
from workers.device.slowdown import apply_slowdown, step_factor


def test_phase_factors_per_worker_and_the_one_factor_forms():
    s = slowdown_of("gpu0=prefill:4,decode:1.5,gpu1=2", "gpu0")
    assert (s.prefill, s.decode) == (4.0, 1.5) and s.describe() == "prefill 4x, decode 1.5x"
    s = slowdown_of("gpu0=prefill:4,decode:1.5,gpu1=2", "gpu1")
    assert (s.prefill, s.decode) == (2.0, 2.0) and s.describe() == "2x"
    assert slowdown_of("gpu0=prefill:4", "gpu0") == Slowdown(4.0, 1.0, slowdown_of("gpu0=prefill:4", "gpu0").why)
    assert not slowdown_of("gpu0=prefill:4,decode:1.5", "gpu2").slowed  # unlisted: 1
    s = slowdown_of("decode:3", "gpu7")  # the unnamed entry: every worker
    assert (s.prefill, s.decode) == (1.0, 3.0)


@pytest.mark.parametrize("bad", ["gpu0=prefill:4,prefill:2", "gpu0=compute:4", "gpu0=prefill:0.5", "gpu0=prefill",
                                 "gpu0=cards:sm_99", "gpu0=prefill:4,3"])
def test_bad_phase_forms_are_named_with_what_is_accepted(bad):
    with pytest.raises(ValueError, match=r"Invalid HETSERVE_SLOWDOWN factor `.*` for worker `gpu0`\. Accepted: .*"
                                         r"gpu0=prefill:4,decode:1\.5.*cards"):
        slowdown_of(bad, "gpu0")


def test_cards_slow_each_device_by_its_compute_and_bandwidth_against_the_reference():
    """Guards `_from_card`: prefill by the TFLOPS ratio, decode by the GB/s ratio, never below 1."""
    t4, a100 = card("sm_75"), card("sm_80")
    assert t4 is not None and a100 is not None and card("8.0") == a100 and card("sm_86:24GiB") == card("sm_86")
    s = slowdown_of("cards:sm_80", "gpu1", "sm_75")
    assert s.prefill == pytest.approx(a100.tflops / t4.tflops) and s.decode == pytest.approx(a100.gbs / t4.gbs)
    assert s.prefill != s.decode and "Tesla T4" in s.why and "A100" in s.why
    assert not slowdown_of("cards:sm_80", "gpu0", "sm_80").slowed  # the reference itself
    assert not slowdown_of("cards:sm_80", "gpu2", "sm_90").slowed  # faster than the reference: at the CPU's speed
    h100 = card("sm_90")
    assert slowdown_of("cards", "gpu0", "sm_80").decode == pytest.approx(h100.gbs / a100.gbs)  # default: sm_90
    assert not slowdown_of("cards", "gpu0", "cpu").slowed and card("cpu") is None


def test_only_simulated_devices_are_slowed():
    assert not device_slowdown("3", "gpu0", False).slowed
    assert device_slowdown("3", "gpu0", True).decode == 3.0


def test_the_router_gives_each_worker_both_factors_and_the_pipeline_weighs_decode():
    """Guards `_slowdown_fields` and `device_speed`'s `.decode`: a card slower at compute than at
    bandwidth reaches its worker with both factors, and a pipeline split weighs the decode one."""
    t4, a100 = parse_simulate("sm_75,sm_80")
    fields = _slowdown_fields("cards:sm_80", "gpu0", t4)
    assert fields["slowdown"] == pytest.approx(card("sm_80").gbs / card("sm_75").gbs)
    assert fields["prefill_slowdown"] == pytest.approx(card("sm_80").tflops / card("sm_75").tflops)
    assert _slowdown_fields("cards:sm_80", "gpu1", a100) == {"slowdown": 1.0, "prefill_slowdown": None}
    assert device_speed(t4, "gpu0=prefill:9,decode:2")[0] == pytest.approx(0.5)
    config = WorkerConfig(socket="/tmp/x.sock", **fields)
    assert config.slowdowns.prefill == fields["prefill_slowdown"] and config.slowdowns.decode == fields["slowdown"]
    assert WorkerConfig(socket="/tmp/x.sock", slowdown=2.0).slowdowns == Slowdown(2.0, 2.0, "its configuration")
    with pytest.raises(ValueError, match=r"`--prefill-slowdown 0.5` is no slowdown factor"):
        WorkerConfig(socket="/tmp/x.sock", prefill_slowdown=0.5)


def _batch(prefill_tokens: list[int], decode_rows: int):
    return SimpleNamespace(prefills=tuple(SimpleNamespace(num_tokens=n) for n in prefill_tokens),
                           decode=SimpleNamespace(num=decode_rows) if decode_rows else None)


def test_a_step_weighs_the_phase_factors_by_their_tokens():
    """Guards `step_factor`: prefill tokens at the prefill factor, decode rows at the decode one."""
    s = Slowdown(5.0, 1.0)
    assert step_factor(s, _batch([], 8)) == 1.0
    assert step_factor(s, _batch([96], 0)) == 5.0
    assert step_factor(s, _batch([60, 36], 4)) == pytest.approx((96 * 5.0 + 4 * 1.0) / 100)
    assert step_factor(s, object()) == 1.0  # no batch: the decode factor


def test_a_prefill_step_is_slowed_by_the_prefill_factor_only():
    def step(batch, kv=None):  # 20 ms of this thread's CPU
        start = time.thread_time()
        while time.thread_time() - start < 0.02:
            pass
        return batch

    model = SimpleNamespace(step=step)
    assert apply_slowdown(model, Slowdown(3.0, 1.0)).prefill == 3.0
    t0 = time.perf_counter()
    model.step(_batch([], 4))
    decode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.step(_batch([128], 0))
    prefill_s = time.perf_counter() - t0
    assert prefill_s >= 0.055 and decode_s < prefill_s


def test_plan_shows_each_gpus_card_estimate_before_anything_ran():
    """Guards `speed_estimate` in `hetserve plan`: a GPU's prefill and decode bounds from its card;
    none for the CPU."""
    from server.commands.plan import plan_device, render_device, speed_estimate

    t4, cpu = parse_simulate("sm_75,cpu")
    entry = {**plan_device(t4), "speed": speed_estimate(t4)}
    assert entry["speed"]["prefill_tflops"] == card("sm_75").tflops and entry["speed"]["decode_gbs"] == 320.0
    assert any(line.split()[:3] == ["speed", "65", "TFLOPS"] for line in render_device(entry))
    assert speed_estimate(cpu) is None and "speed" not in plan_device(t4)


def test_a_plan_with_a_model_carries_each_devices_estimate():
    from server.commands.plan import build_plan
    from workers.contract.defaults import DEFAULT_MODEL_DIR

    plan = build_plan(simulate="sm_75,sm_80", model=str(DEFAULT_MODEL_DIR))
    assert [e["speed"]["decode_gbs"] for e in plan["devices"]] == [card("sm_75").gbs, card("sm_80").gbs]
