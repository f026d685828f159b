"""The pipeline split rule and its placement: layers by memory and speed, flags checked (no processes)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from server.config.models import models_from_args
from server.errors import UsageError
from server.fleet.pipelines import (
    SERVING_BYTES,
    PipelineError,
    backend_for,
    device_speed,
    plan_pipeline,
    serving_charge,
)
from server.fleet.placement import FIRST, STAGE, ModelAsk, PlacementError, Split, place
from tests.checkpoints import make_checkpoint
from workers.contract import DeviceInfo, WorkerConfig
from workers.contract.model_size import read_profile
from workers.contract.pipeline import (
    PipelinePlan,
    PipelineSplitError,
    StagePlan,
    parse_partition,
    split_layers,
)
from workers.contract.slowdown import slowdown_factor
from workers.contract.topology import parse_simulate as parse_topology

BIG = 10**12


def _layers(splits) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in splits]


def test_equal_devices_split_evenly():
    assert _layers(split_layers([100] * 24, [BIG] * 3)) == [(0, 8), (8, 16), (16, 24)]


def test_layers_follow_speed():
    """A device three times as fast gets three times the layers."""
    assert _layers(split_layers([100] * 24, [BIG, BIG], [1, 3])) == [(0, 6), (6, 24)]


def test_a_full_device_keeps_what_fits_and_the_rest_flows_by_speed():
    """Stage 0 holds 2 layers only; the other 22 go to the others in their speed's proportion (1:1)."""
    splits = split_layers([100] * 24, [250, BIG, BIG], [1, 1, 1])
    assert _layers(splits) == [(0, 2), (2, 13), (13, 24)]
    assert "stage 0 full" in splits[1].reason


def test_embedding_and_head_count_on_the_end_stages():
    """The first stage also holds the embedding: with room for 6 layers plus it, it gets fewer layers."""
    splits = split_layers([100] * 12, [900, BIG], [1, 1], first_bytes=400)
    assert splits[0].layers == 5 and splits[0].bytes == 900
    assert sum(s.layers for s in splits) == 12


def test_the_first_stage_is_charged_for_its_serving():
    """Guards the `ahead` charge `split_layers` hands `_water_fill`: with the first stage's serving
    worth two layers, 8 equal layers split 3 + 5 (each stage's step 5 layer-times), not 4 + 4;
    on a faster first stage the charge weighs less (its own layer-times)."""
    assert _layers(split_layers([100] * 8, [BIG, BIG])) == [(0, 4), (4, 8)]
    charged = split_layers([100] * 8, [BIG, BIG], serving=2.0)
    assert _layers(charged) == [(0, 3), (3, 8)] and "serving charged as 2.0 layers" in charged[0].reason
    assert _layers(split_layers([100] * 12, [BIG, BIG], [2, 1], serving=3.0)) == [(0, 7), (7, 12)]
    assert _layers(split_layers([100] * 8, [BIG, BIG], serving=50.0)) == [(0, 1), (1, 8)]  # one layer at least
    assert _layers(split_layers([100] * 8, [BIG, BIG], partition=[4, 4], serving=2.0)) == [(0, 4), (4, 8)]
    with pytest.raises(PipelineSplitError, match="serving charge `-1.0`"):
        split_layers([100] * 8, [BIG, BIG], serving=-1.0)


def test_whole_layers_go_where_they_lengthen_the_slowest_step_least():
    """Guards `_water_fill`'s rounding: stage 1 three times slower, the first charged 2.3 layers
    for serving: the shares are 5.4 + 2.6; 6 + 2 (steps of 8.3 and 6 layer-times) beats the 5 + 3
    that the largest remainder would give (7.3 and 9)."""
    assert _layers(split_layers([100] * 8, [BIG, BIG], [1, 1 / 3], serving=2.3)) == [(0, 6), (6, 8)]


def test_serving_is_charged_where_the_first_stage_computes_on_the_cpu():
    """A simulated (or CPU) first stage is charged `SERVING_BYTES` in its layers' units; a real
    GPU's is not (its layers run on the device while the CPU serves)."""
    sim = parse_topology("sm_80")[0]
    layers, why = serving_charge(sim, [SERVING_BYTES // 4] * 6)
    assert layers == pytest.approx(4.0) and "4.0 layers" in why
    assert serving_charge(replace(sim, simulated=False), [SERVING_BYTES // 4] * 6) == (0.0, "")


def test_no_split_fits_names_the_sizes():
    with pytest.raises(PipelineSplitError, match="do not fit these 2 devices"):
        split_layers([100] * 10, [300, 300])


def test_partition_overrides_and_is_checked():
    assert _layers(split_layers([100] * 24, [BIG, BIG], partition=[10, 14])) == [(0, 10), (10, 24)]
    with pytest.raises(PipelineSplitError, match="24 layers in all"):
        split_layers([100] * 24, [BIG, BIG], partition=[10, 10])
    with pytest.raises(PipelineSplitError, match="Stage 1 .layers 10:24. needs"):
        split_layers([100] * 24, [BIG, 1000], partition=[10, 14])


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PipelineSplitError, match="2 layers cannot be split into 3 stages"):
        split_layers([100, 100], [BIG] * 3)


@pytest.mark.parametrize("text", ["10", "10,x", "10,0", ""])
def test_bad_partitions_are_named(text):
    with pytest.raises(PipelineSplitError, match="is not a list of layer counts"):
        parse_partition(text)


def test_plan_file_round_trips_and_checks_contiguity(tmp_path):
    plan = PipelinePlan("127.0.0.1:1234", (StagePlan(0, 3), StagePlan(3, 6, WorkerConfig(socket="/s", simulate="sm_86"),
                                                                   (("A", "1"),), "gpu1")))
    plan.write(tmp_path / "p.json")
    assert PipelinePlan.read(tmp_path / "p.json") == plan
    PipelinePlan("h:1", (StagePlan(0, 3), StagePlan(4, 6))).write(tmp_path / "bad.json")
    with pytest.raises(PipelineSplitError, match="contiguous"):
        PipelinePlan.read(tmp_path / "bad.json")


def test_slowdown_divides_speed():
    assert slowdown_factor("gpu0=3,gpu2=1.5", "gpu2") == 1.5 and slowdown_factor("2", "gpu9") == 2.0
    dev = parse_topology("sm_86")[0]
    assert device_speed(dev, "gpu0=4")[0] == pytest.approx(0.25)


def _gpu(index: int, kind: str = "cuda") -> DeviceInfo:
    return DeviceInfo(index=index, uuid=f"GPU-{index}", name="real", type=kind, capability=(9, 0),
                      memory_total_bytes=80 << 30, simulated=False)


def test_a_real_gpu_is_not_slowed_and_its_backend_is_decided_by_the_router():
    """Guards `device_slowdown` (workers/contract/slowdown.py: only a simulated device is slowed,
    as only its worker applies the factor) and `backend_for` (server/fleet/pipelines.py), the one
    NCCL-or-gloo rule: the plan carries its answer to every stage."""
    assert device_speed(_gpu(0), "gpu0=4") == device_speed(_gpu(0))
    assert backend_for([_gpu(0), _gpu(1)]) == "nccl" and backend_for([_gpu(0, "rocm"), _gpu(1, "rocm")]) == "nccl"
    assert backend_for([_gpu(0), _gpu(1, "rocm")]) == "gloo"  # across vendors: through host memory
    assert backend_for([_gpu(0), parse_topology("sm_90")[0]]) == "gloo"


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("six") / "six", num_hidden_layers=6)
    return path, read_profile(path)


def test_placement_pipelines_a_model_no_device_holds(six):
    """`--pipeline auto`: a model larger than each device, not than two together, becomes one replica
    over both: the first stage started by the router, the other a stage."""
    _, profile = six
    devices = parse_topology("sm_80:600KiB,sm_86:600KiB")
    placement = place([ModelAsk("six", profile)], devices)
    assert [s.role for s in placement.slots] == [FIRST, STAGE]
    (group,) = placement.pipelines
    # the first stage (serving on its CPU core: its charge outweighs a tiny layer) keeps the fewest
    # layers; the second holds what fits
    assert [(s.start, s.end) for s in group.splits] == [(0, 2), (2, 6)]
    assert "fits no single device" in group.reason and "first stage serving on its CPU core" in group.reason


def test_placement_leaves_a_model_that_fits_alone(six):
    _, profile = six
    placement = place([ModelAsk("six", profile)], parse_topology("sm_80:64MiB,sm_86:64MiB"))
    assert placement.pipelines == () and {s.role for s in placement.slots} == {FIRST, "replica"}


def test_unequal_memories_and_slowed_stages_follow_the_rule(six):
    """sm_75, sm_86, sm_90 with unequal memories and sm_86 slowed 3x: the slow stage gets the fewest
    layers, a stage never holds more than its room, and all six layers are placed in order."""
    _, profile = six
    devices = parse_topology("sm_75:450KiB,sm_86:2MiB,sm_90:2MiB")
    placement = place([ModelAsk("six", profile)], devices, split=Split(3, None, "gpu1=3"))
    (group,) = placement.pipelines
    layers = [s.layers for s in group.splits]
    assert sum(layers) == 6 and group.splits[0].start == 0 and group.splits[-1].end == 6
    assert layers[1] == min(layers) and layers[2] > layers[1]
    assert all(s.bytes <= s.capacity for s in group.splits)
    assert "slowed 3x" in group.reason


def test_pinned_pipeline_and_its_errors(six):
    path, profile = six
    devices = parse_topology("sm_80,sm_86,sm_90")
    placement = place([ModelAsk("six", profile, ("gpu0+gpu2",))], devices, split=Split(partition=(2, 4)))
    (group,) = placement.pipelines
    assert [d.index for d in group.devices] == [0, 2] and _layers(group.splits) == [(0, 2), (2, 6)]
    assert placement.slots[1].model is None  # a pinned model gets exactly its pins: gpu1 stays free
    with pytest.raises(PipelineError, match="cannot be split into 3 stages|at least one layer"):
        plan_pipeline("six", profile, devices, partition=(2, 4))


def test_flags_parse_and_refuse_clearly(six):
    path, _ = six
    config = models_from_args(SimpleNamespace(model=[f"six={path}"], place=["six=gpu0+gpu2,gpu1"],
                                              pipeline="2", pipeline_partition="2,4"))
    assert config.place == (("six", ("gpu0+gpu2", "gpu1")),) and config.pipeline == 2 and config.partition == (2, 4)
    for kwargs, message in [({"place": ["six=gpu0+"]}, "joins devices into one pipeline"),
                            ({"pipeline": "zero"}, "is not a stage count"),
                            ({"pipeline": "3", "pipeline_partition": "2,4"}, "gives 2 stages")]:
        with pytest.raises(UsageError, match=message):
            models_from_args(SimpleNamespace(model=[f"six={path}"], **kwargs))


def test_a_partition_without_a_pipeline_is_refused(six):
    _, profile = six
    with pytest.raises(PlacementError, match="no model is split into a pipeline"):
        place([ModelAsk("six", profile)], parse_topology("sm_80,sm_86"), split=Split(partition=(2, 4)))


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4", "gemma4_moe", "qwen3_5", "qwen3_next"])
def test_the_router_refuses_to_split_exactly_what_the_worker_cannot(tmp_path, family):
    """`unsplittable` (the router's, from config.json) says no where `Transformer.keep_stage`
    (the worker's) raises, and yes where it splits; a refused model's pipeline is a named error."""
    from tests.family_checkpoints import make_family_checkpoint
    from workers.contract.model_size import read_config
    from workers.contract.pipeline import unsplittable
    from workers.model.config import ModelConfig
    from workers.model.transformer import Transformer

    path = make_family_checkpoint(family, tmp_path / family)
    hf = read_config(path)
    model = Transformer.from_config(ModelConfig.from_hf_config(hf))
    try:
        model.keep_stage(0, 1)
        worker_refuses = False
    except ValueError:
        worker_refuses = True
    assert (unsplittable(hf) is not None) == worker_refuses, (family, unsplittable(hf))
    if worker_refuses:
        with pytest.raises(PipelineError, match="cannot be split into pipeline stages"):
            plan_pipeline(family, read_profile(path), parse_topology("sm_80,sm_86"))


def test_the_last_stage_hands_back_logits_that_make_one_workers_fp32_exactly(tmp_path):
    """Guards `_stage_step`'s `_projected` (logits in the head's dtype, half the bytes on the wire)
    and `recv_logits`' cast to fp32: a bfloat16 model split in two gives the last stage bfloat16
    logits whose fp32 cast equals one worker's `step` bit for bit."""
    import torch

    from workers.kv.batch import ForwardBatch, SeqChunk
    from workers.model.loader import load_model

    path = make_checkpoint(tmp_path / "m", num_hidden_layers=4, torch_dtype="bfloat16")
    whole, first, last = (load_model(path, "bfloat16", stage=s) for s in (None, (0, 2), (2, 4)))
    items = [(SeqChunk(0, 5, [0, 1]), [3, 7, 11, 2, 9]), (SeqChunk(0, 3, [2]), [4, 4, 8])]
    pools = [m.model.new_kv_pool(num_blocks=4, block_size=4) for m in (whole, first, last)]
    batch = ForwardBatch.build(items, 4)
    want = whole.model.step(batch, pools[0])  # [N, V] fp32
    hidden = first.model.step(batch, pools[1])  # [T, H] bf16
    got = last.model.step(ForwardBatch.build(items, 4), pools[2], hidden)
    assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
    assert torch.equal(got.float(), want)


def test_pipeline_auto_tries_one_more_device_when_the_split_needs_it(tmp_path):
    """Guards the loop over `auto_device_sets` in `place`: a tied-embedding model whose one-device
    need two devices cover in sum, but whose split does not fit two (the head again on the last
    stage, each stage's KV floor), is placed over three, and the reason says what was tried."""
    path = make_checkpoint(tmp_path / "tied", num_hidden_layers=8, tie_word_embeddings=True, vocab_size=2048)
    devices = parse_topology("sm_80:619KiB,sm_86:619KiB,sm_89:619KiB")
    placement = place([ModelAsk("tied", read_profile(path))], devices)
    assert [s.role for s in placement.slots] == [FIRST, STAGE, STAGE]
    (group,) = placement.pipelines
    assert "tried first 2 devices" in group.reason and "do not fit these 2 devices" in group.reason
