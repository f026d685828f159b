"""Pipeline replicas: one model over several devices, split by what each holds and how fast it runs.

A pipeline is one more kind of placement (server/fleet/placement.py): `--place big=gpu0+gpu2`
joins devices into one replica, `--pipeline N` makes each unpinned model an N-stage replica, and
`--pipeline auto` (the default) splits only a model that fits no single device, over the fewest
devices (the roomiest first) that together hold it. The layers follow the contract's rule
(`workers.contract.pipeline.split_layers`): each stage holds at most its usable memory and gets
layers in proportion to its speed, measured by an earlier replica on the same devices where one
served (workers/contract/stage_timing.py), else estimated (`device_speed`); a first stage that
serves on the host's CPU is charged for that work (`serving_charge`); the rule in full:
docs/pipelines.md. Trade-off: the split is made when the replica starts, so what a replica
measures serves the next start (a restart after a failure keeps its plan); measuring costs two
clock reads per step.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from server.errors import UsageError
from server.fleet.spec import WorkerSpec, build_worker_spec, worker_id
from workers.contract import DeviceInfo, human
from workers.contract.catalog import card
from workers.contract.model_size import ModelProfile, need_on, read_config, usable_bytes
from workers.contract.pipeline import (
    PipelinePlan,
    PipelineSplitError,
    StagePlan,
    StageSplit,
    split_layers,
    unsplittable,
)
from workers.contract.slowdown import device_slowdown
from workers.contract.stage_timing import PipelineTiming, device_key, measured_inputs, model_key, record_key

# Memory bandwidth (GB/s) by compute capability or gfx name: decode speed follows it. Unlisted: 1000.
UNKNOWN_GBS = 1000.0  # a real GPU whose architecture the catalog has no card for


# On a CPU, the first stage's serving work per step is charged as reading this many bytes of
# weights on the same core; calibrated with benchmarks/pipeline.py (docs/benchmarks.md, "Pipelines").
SERVING_BYTES = 28 << 20


class PipelineError(UsageError):
    """A pipeline that cannot be formed: the message says which device or layer count is at fault."""


@dataclass(frozen=True)
class PipelineGroup:
    """One replica of `model` over `devices` (in stage order), their layers and why."""

    model: str
    devices: tuple[DeviceInfo, ...]
    splits: tuple[StageSplit, ...]
    reason: str
    timing_model: str = ""  # the keys its stages record their figures under (workers/contract/stage_timing.py)
    timing_devices: tuple[str, ...] = ()

    @property
    def first(self) -> DeviceInfo:
        return self.devices[0]

    def to_dict(self) -> dict:
        return {"model": self.model, "reason": self.reason,
                "stages": [{"worker_id": worker_id(d), "device": d.name, "capability": d.capability_label,
                            "layers": [s.start, s.end], "weight_bytes": s.bytes, "capacity_bytes": s.capacity,
                            "speed": s.speed, "reason": s.reason}
                           for d, s in zip(self.devices, self.splits, strict=True)]}

    def describe(self) -> str:
        return "; ".join(f"{worker_id(d)} layers {s.start}:{s.end} ({human(s.bytes)})"
                         for d, s in zip(self.devices, self.splits, strict=True))


def device_speed(device: DeviceInfo, slowdown: str = "") -> tuple[float, str]:
    """(relative decode speed, why) of a device before anything ran on it: a simulated device
    computes on this host's CPU like every other, so they are equal; a real GPU's is its catalog
    card's memory bandwidth (decoding reads every weight once per step: workers/contract/catalog.py);
    a simulated device's divided by its `$HETSERVE_SLOWDOWN` decode factor, the knob that makes its
    worker that much slower on purpose (workers/device/slowdown.py)."""
    try:
        factor = device_slowdown(slowdown, worker_id(device), device.simulated, device.arch).decode
    except ValueError as e:
        raise PipelineError(str(e)) from e
    if device.simulated or device.type == "cpu":
        base, why = 1.0, "this host's CPU"
    else:
        known = card(device.capability_label if device.type == "cuda" else (device.arch_name or ""))
        gbs = known.gbs if known is not None else UNKNOWN_GBS
        base, why = gbs / 1000, f"{gbs:g} GB/s"
    return base / factor, why + (f", slowed {factor:g}x" if factor != 1.0 else "")


def serving_charge(device: DeviceInfo, per_layer: Sequence[int]) -> tuple[float, str]:
    """(layer-times, why) charged to a first stage on `device` for serving (it schedules, samples,
    detokenizes and answers HTTP for the whole pipeline): on a device that computes on the host's
    CPU that work shares the core with its layers, so it is charged `SERVING_BYTES` of weight
    reads in its layers' units; on a GPU the layers run on the device while the CPU serves, and
    nothing is charged."""
    if not (device.simulated or device.type == "cpu"):
        return 0.0, ""
    layers = SERVING_BYTES / max(1, sum(per_layer) // max(1, len(per_layer)))
    return layers, f"first stage serving on its CPU core as {layers:.1f} layers"


def layer_bytes(profile: ModelProfile, hf: dict, device: DeviceInfo, dtype: str,
                quantize: str) -> tuple[list[int], int, int]:
    """(bytes of each layer, of the embedding, of the final norm and head) as `device` loads them."""
    hf = hf.get("text_config", hf) if "num_hidden_layers" not in hf else hf
    n = int(hf.get("num_hidden_layers") or 1)
    weights = need_on(profile, device, dtype, quantize).weight_bytes
    vocab, hidden = int(hf.get("vocab_size") or 0), int(hf.get("hidden_size") or 0)
    per = weights / profile.num_parameters if profile.num_parameters else 2  # under one byte where packed
    embed = int(vocab * hidden * per)
    head = 0 if hf.get("tie_word_embeddings", False) else embed
    body = max(0, weights - embed - head)
    return [body // n] * n, embed, head + int(hidden * per)


def timing_keys(hf: dict, devices: Sequence[DeviceInfo], dtype: str, quantize: str,
                slowdown: str = "") -> tuple[str, tuple[str, ...]]:
    """(the model's key, each device's key) under which its stages record what they measured
    (workers/contract/stage_timing.py)."""
    import json

    keys = []
    for d in devices:
        try:
            factor = device_slowdown(slowdown, worker_id(d), d.simulated, d.arch)
        except ValueError as e:
            raise PipelineError(str(e)) from e
        keys.append(device_key(d.uuid, d.simulated, d.index, d.simulate_token or d.capability_label, factor))
    return model_key(json.dumps(hf, sort_keys=True), dtype, quantize), tuple(keys)


def plan_pipeline(model: str, profile: ModelProfile, devices: Sequence[DeviceInfo], dtype: str = "auto",
                  quantize: str = "none", fraction: float | None = None, partition: Sequence[int] | None = None,
                  slowdown: str = "", why: str = "",
                  timings: Mapping[str, PipelineTiming] | None = None) -> PipelineGroup:
    """`model` split over `devices` in this order; `PipelineError` when it cannot be. `timings`:
    what earlier replicas measured (`read_timings`); a record covering these devices gives the
    speeds and charges, else they are estimated (the module docstring)."""
    hf = read_config(Path(profile.path))
    refusal = unsplittable(hf)
    if refusal is not None:
        raise PipelineError(f"`{model}` cannot be split into pipeline stages: a model with {refusal} is served on "
                            "one device only. Accepted: models whose layers each keep their own KV cache")
    per_layer, first, last = layer_bytes(profile, hf, devices[0], dtype, quantize)
    kv = need_on(profile, devices[0], dtype, quantize).kv_bytes // max(1, len(per_layer))
    per_layer = [b + kv for b in per_layer]  # a layer's weights and its share of the KV floor
    capacities = [usable_bytes(d, fraction) for d in devices]
    key, device_keys = timing_keys(hf, devices, dtype, quantize, slowdown)
    measured = measured_inputs((timings or {}).get(record_key(key, device_keys)), device_keys)
    if measured is not None:
        speeds, serving, speed_why = list(measured.speeds), list(measured.ahead), measured.reason
    else:
        estimates = [device_speed(d, slowdown) for d in devices]
        charge, charge_why = serving_charge(devices[0], per_layer)
        speeds, serving = [s for s, _ in estimates], charge
        speed_why = "speeds estimated: " + ", ".join(f"{worker_id(d)} {w}" for d, (_, w) in zip(devices, estimates,
                                                                                                 strict=True))
        speed_why += f"; {charge_why}" if charge_why and partition is None else ""
    try:
        splits = split_layers(per_layer, capacities, speeds, first, last, partition, serving)
    except PipelineSplitError as e:
        names = "+".join(worker_id(d) for d in devices)
        raise PipelineError(f"`{model}` as a pipeline over {names}: {e}") from e
    return PipelineGroup(model, tuple(devices), splits, f"{why}; {speed_why}".lstrip("; "), key, device_keys)


def auto_devices(profile: ModelProfile, free: Sequence[DeviceInfo], dtype: str, quantize: str,
                 fraction: float | None, stages: int | None = None) -> list[DeviceInfo] | None:
    """The devices of a replica: `stages` of them, or the fewest that together hold the model
    (the roomiest first), in device order; None when even all of them do not."""
    if stages is not None:
        ordered = sorted(free, key=lambda d: -usable_bytes(d, fraction))
        return sorted(ordered[:stages], key=lambda d: d.index) if len(ordered) >= stages else None
    return next(auto_device_sets(profile, free, dtype, quantize, fraction), None)


def auto_device_sets(profile: ModelProfile, free: Sequence[DeviceInfo], dtype: str, quantize: str,
                     fraction: float | None) -> Iterator[list[DeviceInfo]]:
    """`--pipeline auto`'s candidate device sets, fewest first, each in device order: the fewest of
    the roomiest devices whose memory together covers the model's one-device need, then one more
    device each time up to all of them. The sum ignores what a split adds (the head again on the
    last stage, each stage's KV floor), so the placement tries the next set when a split fails."""
    ordered = sorted(free, key=lambda d: -usable_bytes(d, fraction))
    total = 0
    for k, d in enumerate(ordered, start=1):
        total += usable_bytes(d, fraction)
        if k >= 2 and total >= need_on(profile, d, dtype, quantize).total:
            for count in range(k, len(ordered) + 1):
                yield sorted(ordered[:count], key=lambda x: x.index)
            return


# The host a replica's stages bind their sockets to: loopback, since they are workers of this host
# (each start meets through a fresh rendezvous in the run directory: workers/pipeline/rendezvous.py).
STAGE_HOST = "127.0.0.1"


def backend_for(devices: Sequence[DeviceInfo]) -> str:
    """The process group's backend, written into the plan that every stage joins by: NCCL (RCCL on
    ROCm) between real GPUs of one vendor, gloo otherwise, through host memory (CPU and simulated
    devices, GPUs of different vendors; workers/pipeline/transport.py)."""
    kinds = {d.type for d in devices}
    return "nccl" if not any(d.simulated for d in devices) and len(kinds) == 1 and kinds <= {"cuda", "rocm"} \
        else "gloo"


def pipeline_spec(group: PipelineGroup, model_dir: Path, settings, run_dir: Path, parent_pid: int, threads: int,
                  base: dict[str, str]) -> WorkerSpec:
    """The first stage's spec, told to start the others from a plan file in `run_dir`: each stage's
    `WorkerConfig` and environment built as for any worker on its device."""
    specs = [build_worker_spec(d, group.model, model_dir, settings, run_dir, parent_pid, threads, base)
             for d in group.devices]
    keys = group.timing_devices or ("",) * len(specs)
    stages = tuple(StagePlan(s.start, s.end, spec.config if i else None, spec.env if i else (),
                             f"{spec.id} ({spec.device.capability_label})", key)
                   for i, (s, spec, key) in enumerate(zip(group.splits, specs, keys, strict=True)))
    path = run_dir / f"{specs[0].id}.pipeline.json"
    PipelinePlan(STAGE_HOST, stages, backend=backend_for(group.devices),
                 notes={"reason": group.reason}, timing_model=group.timing_model).write(path)
    first = specs[0]
    return replace(first, config=replace(first.config, pipeline_plan=str(path)))


def with_pipelines(specs: list[WorkerSpec], groups: Sequence[PipelineGroup], settings, run_dir: Path,
                   threads: int) -> list[WorkerSpec]:
    """`specs` with each pipeline's first-stage worker told to start its other stages (`pipeline_spec`)."""
    import os

    out = list(specs)
    for group in groups:
        i = next(i for i, s in enumerate(out) if s.device.index == group.first.index)
        out[i] = pipeline_spec(group, out[i].model_dir, settings, run_dir, os.getpid(), threads, dict(os.environ))
    return out
