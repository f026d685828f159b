"""Placement: which model each device serves (server/fleet/placement.py `place()`), and where a
model loaded on demand goes (server/fleet/on_demand.py `plan_load()`), both pure functions,
over simulated hosts whose memory the `--simulate` tokens give."""

from __future__ import annotations

import pytest

from server.fleet.on_demand import NoRoom, Resident, plan_load
from server.fleet.placement import (
    FIRST,
    FREE,
    PINNED,
    REPLICA,
    ModelAsk,
    ModelDoesNotFit,
    NoDeviceLeft,
    PinError,
    check_pins,
    place,
)
from workers.contract import parse_simulate
from workers.contract.model_size import ModelProfile

GIB = 1 << 30
HOST = "sm_75:16GiB,sm_86:24GiB,sm_89:48GiB,sm_90:80GiB"


def model(gib: float, dtype: str = "bfloat16", kv_per_token: int = 0, context: int = 4096) -> ModelProfile:
    """A model whose weights take `gib` GiB in 2-byte floats; no KV unless asked."""
    params = int(gib * GIB / 2)
    return ModelProfile("/m", "llama", context, dtype, None, params, params // 2, params // 4096, 0, 0,
                        kv_per_token, "test")


def ask(name, gib, *pins, **kw) -> ModelAsk:
    return ModelAsk(name, model(gib, **kw), tuple(pins))


def roles(p) -> list[tuple[str, str | None, str]]:
    return [(s.worker_id, s.model, s.role) for s in p.slots]


def test_three_models_larger_needs_on_the_devices_that_fit_them_replicas_on_the_rest():
    devices = parse_simulate(HOST)
    p = place([ask("chat", 40), ask("coder", 14), ask("big", 65)], devices)
    assert roles(p) == [("gpu0", "coder", FIRST), ("gpu1", "coder", REPLICA), ("gpu2", "chat", FIRST),
                        ("gpu3", "big", FIRST)]
    assert p.to_dict()["models"] == {"chat": ["gpu2"], "coder": ["gpu0", "gpu1"], "big": ["gpu3"]}
    gpu2 = p.slots[2]
    assert gpu2.need.total == 40 * GIB and gpu2.usable == int(0.9 * 48 * GIB)
    assert "smallest free device that holds chat" in gpu2.reason and "40 GiB" in gpu2.reason
    assert "replica 2 of coder" in p.slots[1].reason
    # A pure function: the same inputs give the same placement.
    assert place([ask("chat", 40), ask("coder", 14), ask("big", 65)], devices) == p


def test_a_replica_goes_to_the_model_with_the_fewest_devices_that_fits():
    p = place([ask("small", 4), ask("mid", 30)], parse_simulate("sm_80:40GiB,sm_80:40GiB,sm_80:8GiB,sm_80:40GiB"))
    # mid (largest) takes the first 40 GiB device, small the 8 GiB one; the two 40 GiB left alternate.
    assert [s.model for s in p.slots] == ["mid", "mid", "small", "small"]


def test_the_dtype_each_device_loads_decides_where_a_model_fits():
    """A float32 checkpoint loads in bfloat16 on sm_80 and up (12 GiB) and float16 below (12 GiB), in
    float32 on a CPU (24 GiB): the CPU with 20 GiB cannot hold it."""
    devices = parse_simulate("cpu:20GiB,sm_75:16GiB")
    p = place([ask("m", 12, dtype="float32")], devices)
    assert roles(p) == [("cpu0", None, FREE), ("gpu1", "m", FIRST)]
    assert p.slots[1].need.dtype == "float16" and "no model fits" in p.slots[0].reason


def test_fp8_makes_a_model_fit_that_does_not_in_bfloat16():
    devices = parse_simulate("sm_89:24GiB")
    with pytest.raises(ModelDoesNotFit):
        place([ask("m", 28)], devices)
    p = place([ask("m", 28)], devices, quantize="fp8")
    assert p.slots[0].model == "m" and p.slots[0].need.weight_bytes < 24 * GIB


def test_kv_cache_of_one_sequence_counts():
    devices = parse_simulate("sm_90:10GiB")
    assert place([ask("m", 8)], devices).slots[0].model == "m"
    with pytest.raises(ModelDoesNotFit) as e:  # 8 GiB + 4096 tokens x 512 KiB > 9 GiB usable
        place([ask("m", 8, kv_per_token=256 << 10)], devices)
    assert "KV 2 GiB (4096 tokens)" in str(e.value)


def test_a_model_that_fits_nowhere_is_named_with_the_figures():
    with pytest.raises(ModelDoesNotFit) as e:
        place([ask("chat", 14), ask("huge", 100)], parse_simulate(HOST))
    message = str(e.value)
    assert "`huge` fits no device" in message and "100 GiB" in message
    for figures in ("gpu0 (7.5): 14.4 GiB usable of 16 GiB", "gpu3 (9.0): 72 GiB usable of 80 GiB"):
        assert figures in message


def test_more_models_than_devices_names_who_holds_them():
    with pytest.raises(NoDeviceLeft) as e:
        place([ask("a", 60), ask("b", 50)], parse_simulate(HOST))
    assert "`b` has no free device" in str(e.value) and "gpu3 serves `a`" in str(e.value)
    assert "--max-loaded-models" in str(e.value)


def test_pins_by_worker_id_index_and_uuid():
    devices = parse_simulate(HOST)
    p = place([ask("chat", 10, "gpu3", "1"), ask("coder", 4, devices[0].uuid.lower())], devices)
    assert roles(p) == [("gpu0", "coder", PINNED), ("gpu1", "chat", PINNED), ("gpu2", None, FREE),
                        ("gpu3", "chat", PINNED)]
    assert "pinned by --place chat=gpu3,1" in p.slots[1].reason
    # Pinned models get exactly their pins: gpu2 stays free though both fit it.
    assert "no model fits" in p.slots[2].reason


@pytest.mark.parametrize(("asks", "needle"), [
    ([("chat", 10, "gpu0"), ("coder", 4, "0")], "gpu0 is pinned to both `chat` and `coder`"),
    ([("chat", 10, "gpu1", "gpu1")], "names gpu1 twice"),
    ([("chat", 10, "gpu7")], "no device `gpu7`. Known: gpu0 (index 0"),
    ([("chat", 20, "gpu0")], "`chat` needs weights 20 GiB (float16) + KV 0 B (4096 tokens) = 20 GiB on gpu0 (7.5): "
                             "14.4 GiB usable of 16 GiB"),
])
def test_pins_that_conflict_or_cannot_hold_the_model_are_refused(asks, needle):
    with pytest.raises(PinError) as e:
        place([ask(*a) for a in asks], parse_simulate(HOST))
    assert needle in str(e.value)


def test_a_pinned_device_is_taken_before_the_others_choose():
    """`big` would take gpu3 by best fit, but `chat` is pinned there: big then fits nowhere free."""
    with pytest.raises(NoDeviceLeft):
        place([ask("big", 65), ask("chat", 10, "gpu3")], parse_simulate(HOST))


# --- loading on demand --------------------------------------------------------------------------
def test_a_model_loaded_on_demand_takes_the_smallest_free_device_that_holds_it():
    devices = parse_simulate(HOST)
    plan = plan_load(ask("coder", 12), devices, {3: "chat"}, ["chat"])
    assert [s.worker_id for s in plan.start] == ["gpu0"] and plan.stop == () and plan.unload == ()


def test_a_replicas_device_is_taken_before_a_model_is_unloaded():
    devices = parse_simulate(HOST)
    plan = plan_load(ask("coder", 12), devices, {0: "chat", 1: "chat", 2: "chat", 3: "big"}, ["big", "chat"])
    assert [s.worker_id for s in plan.start] == ["gpu0"] and plan.stop == (0,) and plan.unload == ()
    assert "replica of chat" in plan.reason


def test_the_least_recently_used_model_makes_room_under_max_loaded_models():
    devices = parse_simulate("sm_80,sm_80,sm_80")
    serving = {0: "a", 1: "b", 2: "b"}
    plan = plan_load(ask("c", 1), devices, serving, ["b", "a"], max_loaded=2)
    assert plan.unload == ("b",) and plan.stop == (1, 2) and plan.start[0].worker_id == "gpu1"
    # `b` protected (pinned or loading): `a` goes instead.
    plan = plan_load(ask("c", 1), devices, serving, ["b", "a"], protected={"b"}, max_loaded=2)
    assert plan.unload == ("a",) and plan.stop == (0,) and plan.start[0].worker_id == "gpu0"
    with pytest.raises(NoRoom) as e:
        plan_load(ask("c", 1), devices, serving, ["b", "a"], protected={"a", "b"}, max_loaded=2)
    assert "--max-loaded-models 2" in str(e.value) and "none may be unloaded" in str(e.value)


def test_a_model_inside_its_residence_is_not_unloaded_and_the_answer_says_how_long():
    """Guards `resident` in server/fleet/on_demand.py `plan_load`: a model loaded less than
    `--model-min-residence-s` ago is passed over; when only such models stand in the way the
    answer is `Resident`, with the seconds until the first may go."""
    devices = parse_simulate("sm_80,sm_80,sm_80")
    serving = {0: "a", 1: "b", 2: "b"}
    plan = plan_load(ask("c", 1), devices, serving, ["b", "a"], max_loaded=2, resident={"b": 10.0, "a": 0.0})
    assert plan.unload == ("a",)  # `b` is the least recently used but resident; `a`'s residence is over
    with pytest.raises(Resident) as e:
        plan_load(ask("c", 1), devices, serving, ["b", "a"], max_loaded=2, resident={"b": 10.0, "a": 2.5})
    assert e.value.retry_after == 3 and "`a`" in str(e.value) and "--model-min-residence-s" in str(e.value)
    one = parse_simulate("sm_80")
    with pytest.raises(Resident):  # the device loop: the only device holds a resident model
        plan_load(ask("c", 1), one, {0: "a"}, ["a"], resident={"a": 5.0})


def test_without_a_free_device_that_holds_it_the_lru_holder_unloads():
    devices = parse_simulate("sm_75:16GiB,sm_90:80GiB")
    plan = plan_load(ask("big", 60), devices, {0: "small", 1: "chat"}, ["chat", "small"])
    assert plan.unload == ("chat",) and plan.start[0].worker_id == "gpu1"  # small's device cannot hold big
    with pytest.raises(NoRoom) as e:
        plan_load(ask("big", 60), devices, {0: "small", 1: "chat"}, ["chat", "small"], protected={"chat"})
    assert "gpu1 serves `chat`" in str(e.value)
    with pytest.raises(ModelDoesNotFit):
        plan_load(ask("huge", 100), devices, {}, [])


def test_a_pinned_model_loads_on_its_pins_and_a_device_pinned_to_another_is_never_taken():
    devices = parse_simulate("sm_80,sm_80,sm_80")
    plan = plan_load(ask("chat", 1, "gpu1"), devices, {1: "coder", 2: "coder"}, ["coder"])
    assert [s.worker_id for s in plan.start] == ["gpu1"] and plan.stop == (1,) and plan.unload == ()
    plan = plan_load(ask("x", 1), devices, {0: "coder", 1: "coder", 2: "coder"}, ["coder"],
                     pinned_devices={0: "coder", 1: "coder"})
    assert plan.stop == (2,) and plan.start[0].worker_id == "gpu2"


def test_gpu_memory_utilization_is_the_share_placement_offers():
    """Guards `fraction` in `place`, `check_pins` and `plan_load`: placement sized every device
    at 0.9 of its memory whatever `--gpu-memory-utilization` said, so a model the workers had no
    room for was placed, and one they had room for refused."""
    devices = parse_simulate("sm_90:20GiB")
    assert place([ask("m", 17)], devices).slots[0].model == "m"  # 17 GiB <= 18 GiB (0.9)
    with pytest.raises(ModelDoesNotFit) as e:
        place([ask("m", 17)], devices, fraction=0.8)
    assert "16 GiB usable of 20 GiB" in str(e.value)
    assert place([ask("m", 19)], devices, fraction=0.98).slots[0].model == "m"
    with pytest.raises(PinError):
        check_pins([ask("m", 17, "gpu0")], devices, fraction=0.8)
    with pytest.raises(ModelDoesNotFit, match="gpu0 16 GiB usable"):
        plan_load(ask("m", 17), devices, {}, [], fraction=0.8)
    assert [s.worker_id for s in plan_load(ask("m", 17), devices, {}, []).start] == ["gpu0"]
