"""What pipeline stages measure, kept per host, and the split that uses it (workers/contract/stage_timing.py).

Unit tests over hand-made figures (the split, the file, the keys), then one real 2-stage pipeline
whose second stage is slowed 3x: what its stages record, and the split planned from it.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from server.fleet.pipelines import plan_pipeline, timing_keys
from server.fleet.placement import ModelAsk, Split, place, split_of
from tests.checkpoints import make_checkpoint
from workers.contract.model_size import read_config, read_profile
from workers.contract.pipeline import PipelinePlan, StagePlan, split_layers
from workers.contract.slowdown import Slowdown
from workers.contract.stage_timing import (
    ENV_STAGE_TIMINGS,
    MIN_STEPS,
    PipelineTiming,
    StageTiming,
    device_key,
    measured_inputs,
    model_key,
    read_timings,
    record_key,
    record_timing,
)
from workers.contract.topology import parse_simulate as parse_topology
from workers.pipeline.metrics import StageClock, TimingRecorder


def _stage(device: str, layers: int, per_layer_ms: float, besides_ms: float = 0.0, steps: int = 100,
           host_cpu: bool = True) -> StageTiming:
    """A stage's figures: `per_layer_ms` per layer and step, `besides_ms` of CPU per step outside its layers."""
    wall = per_layer_ms * 1e-3 * layers * steps
    return StageTiming(device, layers, steps, wall, wall + besides_ms * 1e-3 * steps, host_cpu)


def test_a_stages_figures_give_its_time_per_layer_and_its_work_besides():
    s = StageTiming("d", layers=4, steps=50, layer_seconds=2.0, busy_seconds=3.0, host_cpu=True)
    assert s.per_layer == pytest.approx(0.01)  # 2 s over 50 steps of 4 layers
    assert s.besides == pytest.approx(0.02)  # 1 busy second outside the layers over 50 steps
    assert StageTiming("d", 4, 50, 2.0, 1.0, True).besides == 0.0  # never negative


def test_measured_inputs_need_every_device_and_enough_steps():
    timing = PipelineTiming("m", (_stage("a", 4, 1.0, 2.0), _stage("b", 4, 3.0, 0.5)), time.time())
    got = measured_inputs(timing, ["a", "b"])
    assert got.speeds == pytest.approx((1000.0, 1000.0 / 3))
    # the first stage charged its own work besides its layers, the other the others' (in its own layer-times)
    assert got.ahead == pytest.approx((2.0, 0.5 / 3.0))
    assert "measured over 100 steps" in got.reason and "1.00 ms, 3.00 ms per layer" in got.reason
    swapped = measured_inputs(timing, ["b", "a"])  # b first now: it is charged the first stage's work
    assert swapped.speeds == pytest.approx((1000.0 / 3, 1000.0)) and swapped.ahead == pytest.approx((2.0 / 3, 0.5))
    assert measured_inputs(timing, ["a", "c"]) is None  # a device it never measured
    assert measured_inputs(timing, ["a"]) is None
    assert measured_inputs(None, ["a", "b"]) is None
    few = PipelineTiming("m", (_stage("a", 4, 1.0, steps=MIN_STEPS - 1), _stage("b", 4, 3.0)), time.time())
    assert measured_inputs(few, ["a", "b"]) is None
    gpu = PipelineTiming("m", (_stage("a", 4, 1.0, 2.0, host_cpu=False), _stage("b", 4, 1.0, 2.0)), time.time())
    assert measured_inputs(gpu, ["a", "b"]).ahead == pytest.approx((0.0, 2.0))  # a GPU's layers run while its CPU works


def test_the_split_follows_what_was_measured():
    """Guards `split_layers`' per-stage charges: measured speeds 1 : 1/3 and the first stage's serving
    worth one layer put 12 layers as 9 + 3 (10 and 9 layer-times), where the speeds alone give 9 + 3
    too, and a transport charge on the slow stage moves one more layer off it."""
    layers = [100] * 12
    assert [s.layers for s in split_layers(layers, [10**9] * 2, [3.0, 1.0], serving=[1.0, 0.0])] == [9, 3]
    charged = split_layers(layers, [10**9] * 2, [3.0, 1.0], serving=[1.0, 1.0])
    assert [s.layers for s in charged] == [10, 2]
    assert "serving charged as 1.0 layers" in charged[0].reason and "transport charged as 1.0" in charged[1].reason
    with pytest.raises(ValueError, match="one number .* or 2"):
        split_layers(layers, [10**9] * 2, [1.0, 1.0], serving=[1.0])


def test_records_round_trip_and_what_cannot_be_read_is_skipped(tmp_path):
    path = tmp_path / "deep" / "timings.json"
    assert read_timings(path) == {}  # no file: nothing measured yet
    a = PipelineTiming("model-a", (_stage("x", 2, 1.0), _stage("y", 2, 2.0)), 1000.0)
    b = PipelineTiming("model-b", (_stage("x", 3, 1.5), _stage("z", 1, 1.0)), 2000.0)
    a_elsewhere = PipelineTiming("model-a", (_stage("x", 2, 1.0), _stage("z", 2, 2.0)), 1500.0)
    for timing in (a, b, a_elsewhere):
        record_timing(path, timing)
    # a newer record of one model on the same devices (in any order) replaces the older
    record_timing(path, PipelineTiming("model-a", a.stages[::-1], 3000.0))
    got = read_timings(path)
    assert set(got) == {"model-a on x + y", "model-a on x + z", "model-b on x + z"}
    assert got["model-b on x + z"] == b and got["model-a on x + y"].measured_at == 3000.0
    assert got["model-a on x + z"] == a_elsewhere  # the same model on other devices: its own record
    raw = json.loads(path.read_text())
    raw["records"]["model-b on x + z"]["stages"][0].pop("layers")  # another version's record: skipped
    path.write_text(json.dumps(raw))
    assert set(read_timings(path)) == {"model-a on x + y", "model-a on x + z"}
    path.write_text("{not json")
    assert read_timings(path) == {}


def test_keys_name_the_model_as_computed_and_each_device_across_runs():
    assert model_key('{"a": 1}', "auto", "none") != model_key('{"a": 2}', "auto", "none")
    assert model_key('{"a": 1}', "auto", "none") != model_key('{"a": 1}', "bfloat16", "none")
    assert device_key("GPU-1234", False, 0, "sm_80") == "GPU-1234"  # a real GPU: its UUID, whatever its index
    assert device_key("sim-0", True, 0, "sm_80") == "simulated 0 sm_80"
    assert device_key("sim-0", True, 0, "sm_80", Slowdown(3.0, 3.0)) == "simulated 0 sm_80 slowed 3x"  # another device
    assert device_key("sim-0", True, 0, "sm_80", Slowdown(4.0, 1.5)) == \
        "simulated 0 sm_80 slowed prefill 4x, decode 1.5x"


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("six") / "six", num_hidden_layers=6)
    return path, read_profile(path)


def _timing_for(profile, devices, per_layer_ms, besides_ms=(0.0, 0.0), slowdown=""):
    key, keys = timing_keys(read_config(profile.path), devices, "auto", "none", slowdown)
    stages = tuple(_stage(k, 3, ms, b) for k, ms, b in zip(keys, per_layer_ms, besides_ms, strict=True))
    timing = PipelineTiming(key, stages, time.time())
    return {timing.key: timing}


def test_a_replica_is_split_by_its_measured_speeds_where_a_record_covers_it(six):
    """Two simulated devices are estimated equal (the same CPU, the first charged for serving);
    measured, the second took three times as long per layer: it gets the fewer layers, as the rule
    gives for the measured speeds, and the reason says measured."""
    _, profile = six
    devices = parse_topology("sm_80:1MiB,sm_86:1MiB")
    estimated = plan_pipeline("six", profile, devices)
    assert "speeds estimated" in estimated.reason
    timings = _timing_for(profile, devices, (1.0, 3.0))
    measured = plan_pipeline("six", profile, devices, timings=timings)
    assert "speeds measured over 100 steps" in measured.reason
    assert [s.layers for s in measured.splits] == [s.layers for s in split_layers([1] * 6, [10**9] * 2, [1.0, 1 / 3])]
    assert measured.splits[1].layers < estimated.splits[1].layers
    # placement takes the same record through its Split (`--pipeline 2`: the model fits one device)
    (group,) = place([ModelAsk("six", profile)], devices, split=Split(2, timings=timings)).pipelines
    assert [s.layers for s in group.splits] == [s.layers for s in measured.splits]
    # another device set, or another dtype: not this record, so estimated
    assert "estimated" in plan_pipeline("six", profile, parse_topology("sm_80,sm_90"), timings=timings).reason
    assert "estimated" in plan_pipeline("six", profile, devices, dtype="float32", timings=timings).reason
    # a slowed simulated device is another device than the one measured unslowed
    assert "estimated" in plan_pipeline("six", profile, devices, slowdown="gpu1=3", timings=timings).reason


def test_split_of_reads_the_hosts_file(six, tmp_path, monkeypatch):
    _, profile = six
    devices = parse_topology("sm_80:600KiB,sm_86:600KiB")
    path = tmp_path / "t.json"
    for timing in _timing_for(profile, devices, (1.0, 3.0)).values():
        record_timing(path, timing)
    monkeypatch.setenv(ENV_STAGE_TIMINGS, str(path))
    split = split_of(SimpleNamespace(models=SimpleNamespace(pipeline=None, partition=None)))
    (group,) = place([ModelAsk("six", profile)], devices, split=split).pipelines
    assert "speeds measured" in group.reason


def _plan(model_key_: str = "m") -> PipelinePlan:
    return PipelinePlan("127.0.0.1:1", (StagePlan(0, 2, timing_device="a"), StagePlan(2, 6, timing_device="b")),
                        timing_model=model_key_)


def test_the_first_stage_records_once_every_stage_has_enough_steps(tmp_path):
    """`TimingRecorder`: nothing before `MIN_STEPS` on every stage; then the stages' figures (its own
    clock, the others' status files) under the plan's keys; a plan without a model key records nothing."""
    follower = tmp_path / "stage1.json"
    clock = StageClock()
    path = tmp_path / "timings.json"
    recorder = TimingRecorder(_plan(), clock, [str(follower)], path)
    for _ in range(MIN_STEPS):
        clock.add(0.002, 0.002)
    follower.write_text(json.dumps({"steps": MIN_STEPS - 1, "step_seconds": 0.5, "busy_seconds": 0.6,
                                    "host_cpu": True}))
    assert not recorder.record() and not path.exists()  # stage 1 is one step short
    follower.write_text(json.dumps({"steps": MIN_STEPS, "step_seconds": 0.5, "busy_seconds": 0.6,
                                    "host_cpu": False}))
    assert recorder.record()
    (timing,) = read_timings(path).values()
    assert timing.model == "m" and [s.device for s in timing.stages] == ["a", "b"]
    assert [s.layers for s in timing.stages] == [2, 4] and timing.stages[1].host_cpu is False
    assert timing.stages[0].per_layer == pytest.approx(0.001) and timing.stages[1].besides == pytest.approx(0.1 / 32)
    assert timing.stages[0].besides == 0.0  # `add` without a busy figure: its layers only
    assert not recorder.record()  # within RECORD_S of the last record
    assert recorder.record(force=True)  # when the pipeline stops
    assert not TimingRecorder(_plan(""), clock, [str(follower)], tmp_path / "none.json").record(force=True)


def test_a_clock_counts_its_layers_and_its_busy_time_between_steps_not_its_waits(monkeypatch):
    """Guards `StageClock.measure`'s busy rule: the time between two steps counts as work besides
    the layers, less what was spent waiting (`waiting`), not across an idle gap, and not when
    another thread ran a step in between."""
    from workers.pipeline import metrics

    seen = []
    clock = StageClock(seen.append, host_cpu=False)
    with clock.measure():
        time.sleep(0.02)  # the layers
    time.sleep(0.03)  # work between two steps (sampling, serving)
    with clock.waiting():
        time.sleep(0.1)  # waiting for the other stages: not work
    with clock.measure():
        time.sleep(0.02)
    figures = clock.figures()
    assert figures["steps"] == 2 and 0.04 <= figures["step_seconds"] < 0.07
    assert 0.07 <= figures["busy_seconds"] < 0.12 and figures["host_cpu"] is False  # the layers and 0.03 s besides
    assert seen == [clock]  # reported once: the second step came within REPORT_S
    # a step on another thread (an idle engine's first step, on the HTTP thread) in between: the time
    # since this thread's own last step is not work (guards `StageClock._thread`)
    two = StageClock()

    def step():
        with two.measure():
            time.sleep(0.01)

    step()
    time.sleep(0.05)
    other = threading.Thread(target=step)
    other.start()
    other.join()
    time.sleep(0.05)
    step()
    assert two.figures()["busy_seconds"] == pytest.approx(two.figures()["step_seconds"])
    monkeypatch.setattr(metrics, "IDLE_S", 0.01)  # a gap longer than this, not waited, is idle
    idle = StageClock()
    for _ in range(2):
        with idle.measure():
            time.sleep(0.02)
        time.sleep(0.03)
    assert idle.figures()["busy_seconds"] == pytest.approx(idle.figures()["step_seconds"])


@pytest.mark.slow
def test_a_served_pipeline_records_what_its_stages_measured(six, tmp_path):
    """A real 2-stage pipeline, its second stage slowed 3x: stopped after some 50 steps, it has
    recorded both stages under the plan's keys, the slowed one the slower per layer, and a replica
    planned from that record gives the slowed device fewer layers than the even split."""
    from tests.pipeline_harness import Served

    model, profile = six
    devices = parse_topology("sm_80,sm_86")
    keys = timing_keys(read_config(model), devices, "float32", "none", "gpu1=3")
    path = tmp_path / "timings.json"
    served = Served(tmp_path, "slow", model, ["sm_80", "sm_86"], timing=keys,
                    env={ENV_STAGE_TIMINGS: str(path), "HETSERVE_SLOWDOWN": "slow-1=3"})
    try:
        served.wait_ready()
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: served.generate(f"count {i} steps", 48, ignore_eos=True), range(4)))
    finally:
        served.stop()
    timing = read_timings(path)[record_key(*keys)]
    assert [s.device for s in timing.stages] == list(keys[1]) and timing.steps >= MIN_STEPS
    first, slowed = timing.stages
    assert (first.layers, slowed.layers) == (3, 3)
    assert slowed.per_layer > 1.5 * first.per_layer, (first, slowed)
    group = plan_pipeline("six", profile, devices, "float32", slowdown="gpu1=3", timings=read_timings(path))
    assert "speeds measured" in group.reason and group.splits[1].layers < 3
