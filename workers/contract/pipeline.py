"""A pipeline replica: one model's layers split over several devices, each stage its own worker.

Design: the router decides the split (`split_layers`) and writes a `PipelinePlan` file; the first
stage's worker starts the others from it (each from its own `WorkerConfig` and environment) and
joins them in one `torch.distributed` group; both sides read the plan through this module. Each
stage holds what it can (`capacity`, after its share of the KV cache) and gets layers in
proportion to its measured `speed`, filled like water: a stage that cannot hold its share keeps
what fits and the rest flows to the others by speed; the first stage also holds the embedding and
is charged `serving` layer-times for the scheduling and sampling it does, the last the final norm
and head. An explicit `--pipeline-partition` is checked against the same capacities. Trade-off:
speed is one number per device, not a per-layer cost model; a model's layers cost about the
same, so the rule needs no more."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workers.contract.config import WorkerConfig
from workers.contract.sizes import human


class PipelineSplitError(ValueError):
    """A split that cannot be made: the message says which stage and by how much."""


@dataclass(frozen=True)
class StageSplit:
    """One stage's layers [start, end), its weight bytes and why it got them."""

    start: int
    end: int
    bytes: int
    capacity: int
    speed: float
    reason: str

    @property
    def layers(self) -> int:
        return self.end - self.start


def _mib(n: float) -> str:
    return human(int(n))


def _stage_bytes(layer_bytes: Sequence[int], start: int, end: int, first: int, last: int) -> int:
    return sum(layer_bytes[start:end]) + (first if start == 0 else 0) + (last if end == len(layer_bytes) else 0)


def _water_fill(n: int, speeds: Sequence[float], caps: Sequence[int], ahead: Sequence[float]) -> list[int]:
    """Integer layer counts summing to `n`, each >= 1 and <= its cap, that end every stage's step
    together where caps allow: stage i's time is (ahead[i] + its layers) / speed[i]."""
    k = len(speeds)

    def shares(level: float) -> list[float]:  # each stage's layers if every stage's time were `level`
        return [min(float(caps[i]), max(0.0, level * speeds[i] - ahead[i])) for i in range(k)]

    lo, hi = 0.0, (n + sum(ahead)) / min(speeds) + 1.0
    for _ in range(200):  # the level at which the shares add up to n (they grow with it)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(shares(mid)) < n else (lo, mid)
    share = shares(hi)
    counts = [max(1, min(caps[i], int(share[i]))) for i in range(k)]

    def time(i: int, extra: int = 0) -> float:
        return (ahead[i] + counts[i] + extra) / speeds[i]

    # each layer left to the stage whose step it lengthens least (within its cap), so the slowest
    # stage's step, which sets the pipeline's pace, is as short as whole layers allow
    while sum(counts) < n and any(counts[i] < caps[i] for i in range(k)):
        counts[min((i for i in range(k) if counts[i] < caps[i]), key=lambda i: time(i, 1))] += 1
    while sum(counts) > n:  # the floors of 1 overshot: take back from the slowest stage that can spare one
        counts[max((j for j in range(k) if counts[j] > 1), key=time)] -= 1
    return counts


def split_layers(layer_bytes: Sequence[int], capacities: Sequence[int], speeds: Sequence[float] | None = None,
                 first_bytes: int = 0, last_bytes: int = 0, partition: Sequence[int] | None = None,
                 serving: float | Sequence[float] = 0.0) -> tuple[StageSplit, ...]:
    """The stages' layer ranges for a model of `len(layer_bytes)` layers over devices holding
    `capacities` bytes of weights each, weighted by `speeds` (None: equal) with the first stage
    charged `serving` layer-times for its serving work (a sequence: each stage its own charge,
    as measured: workers/contract/stage_timing.py), or as `partition` (layers per stage) says.
    Raises `PipelineSplitError` when no split fits."""
    n, k = len(layer_bytes), len(capacities)
    speeds = list(speeds) if speeds is not None else [1.0] * k
    if k < 2:
        raise PipelineSplitError(f"A pipeline needs at least 2 stages, got `{k}`")
    if len(speeds) != k or min(speeds) <= 0:
        raise PipelineSplitError(f"Stage speeds `{list(speeds)}` must be {k} positive numbers")
    if n < k:
        raise PipelineSplitError(f"A model of {n} layers cannot be split into {k} stages (one layer each at least)")
    avg = max(1, sum(layer_bytes) // n)
    ahead = [0.0] * k
    if partition is not None:
        counts, why = list(partition), "as --pipeline-partition says"
        if len(counts) != k or min(counts) < 1 or sum(counts) != n:
            raise PipelineSplitError(f"`--pipeline-partition {','.join(map(str, counts))}` must give each of the {k} "
                                     f"stages at least one layer and {n} layers in all")
    else:
        extra = [first_bytes if i == 0 else 0 for i in range(k)]
        extra[-1] += last_bytes
        caps = [max(0, (c - e) // avg) for c, e in zip(capacities, extra, strict=True)]
        if sum(caps) < n or min(caps) < 1:
            total = sum(layer_bytes) + first_bytes + last_bytes
            raise PipelineSplitError(f"The model's {_mib(total)} of weights do not fit these {k} devices (they hold "
                                     f"{', '.join(_mib(c) for c in capacities)}); add a device or quantize")
        ahead = [float(serving)] + [0.0] * (k - 1) if isinstance(serving, (int, float)) else list(serving)
        if len(ahead) != k or min(ahead) < 0:
            raise PipelineSplitError(f"The stages' serving charge `{serving}` must be 0 or more layer-times, "
                                     f"one number (the first stage's) or {k} (one per stage)")
        counts = _water_fill(n, speeds, caps, ahead)
        capped = [i for i in range(k) if counts[i] == caps[i] and counts[i] < n * speeds[i] / sum(speeds) - 0.5]
        why = ("layers by speed" if not capped else
               f"layers by speed; stage {', '.join(map(str, capped))} full, the rest to the others")
    splits, start = [], 0
    for i, c in enumerate(counts):
        end = start + c
        b = _stage_bytes(layer_bytes, start, end, first_bytes, last_bytes)
        if b > capacities[i]:
            raise PipelineSplitError(f"Stage {i} (layers {start}:{end}) needs {_mib(b)} of weights; its device holds "
                                     f"{_mib(capacities[i])}")
        share = f"{speeds[i] / sum(speeds):.0%} of the speed"
        if partition is None and ahead[i]:
            share += f", {'serving' if i == 0 else 'transport'} charged as {ahead[i]:.1f} layers"
        splits.append(StageSplit(start, end, b, int(capacities[i]), float(speeds[i]),
                                 f"{c} layers: {why} ({share}, holds {_mib(capacities[i])})"))
        start = end
    return tuple(splits)


def unsplittable(hf: dict) -> str | None:
    """What keeps a checkpoint (its config.json) from being split into stages, or None; the
    worker's `Transformer.keep_stage` refuses the same models (tests/test_pipeline_split.py
    holds the two equal on the families' checkpoints)."""
    text = hf.get("text_config") or hf
    kind = str(text.get("model_type") or hf.get("model_type") or "")
    if kind.startswith("gemma4"):
        parts = [why for on, why in ((int(text.get("hidden_size_per_layer_input", 256) or 0), "per-layer inputs"),
                                     (int(text.get("num_kv_shared_layers") or 0),
                                      "layers that read another layer's KV")) if on]
        return " and ".join(parts) or None
    return None


def parse_partition(text: str) -> tuple[int, ...]:
    """`--pipeline-partition 10,14` -> (10, 14); a clear error for anything else."""
    try:
        counts = tuple(int(p) for p in text.split(","))
    except ValueError:
        counts = ()
    if len(counts) < 2 or min(counts) < 1:
        raise PipelineSplitError(f"`--pipeline-partition {text}` is not a list of layer counts. Accepted: two or more "
                                 f"positive integers separated by commas, one per stage, e.g. `10,14`")
    return counts


# ---- the plan file ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagePlan:
    """One stage: its layers [start, end), its worker's configuration (None for the first stage,
    which runs its own) and environment."""

    start: int
    end: int
    config: WorkerConfig | None = None
    env: tuple[tuple[str, str], ...] = ()
    device: str = ""  # its device, as `/workers` shows it (e.g. `gpu2 (sm_86)`)
    timing_device: str = ""  # its device's key in the stage timings (workers/contract/stage_timing.py)


@dataclass(frozen=True)
class PipelinePlan:
    """The stages of one replica, in order, and the host their sockets bind to (`address`: a host,
    or `host:port` whose port is not used: the first stage meets the others through a fresh
    rendezvous at each start, workers/pipeline/rendezvous.py)."""

    address: str
    stages: tuple[StagePlan, ...]
    timeout_s: float = 300.0  # a stage silent for longer than this is gone (the process group's timeout)
    backend: str = "gloo"
    notes: dict = field(default_factory=dict)
    timing_model: str = ""  # the model's key in the stage timings ("": the stages record nothing)

    @property
    def world_size(self) -> int:
        return len(self.stages)

    @property
    def host(self) -> str:
        """The address the stages' sockets bind to (`address` without a port)."""
        if self.address.startswith("["):  # [v6]:port
            return self.address[1:].partition("]")[0]
        return self.address.partition(":")[0] if self.address.count(":") == 1 else self.address

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def read(cls, path: str | Path) -> PipelinePlan:
        try:
            raw = json.loads(Path(path).read_text())
            stages = tuple(StagePlan(s["start"], s["end"],
                                     None if s.get("config") is None else WorkerConfig.from_dict(s["config"]),
                                     tuple(tuple(p) for p in s.get("env", ())), s.get("device", ""),
                                     s.get("timing_device", ""))
                           for s in raw["stages"])
            plan = cls(raw["address"], stages, float(raw.get("timeout_s", 300.0)), raw.get("backend", "gloo"),
                       raw.get("notes", {}), raw.get("timing_model", ""))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PipelineSplitError(f"Pipeline plan `{path}` cannot be read: {e}") from e
        if (len(stages) < 2 or stages[0].start != 0
                or any(a.end != b.start for a, b in zip(stages, stages[1:], strict=False))):
            raise PipelineSplitError(f"Pipeline plan `{path}` does not give contiguous layers from 0 to its stages")
        if any(stage.config is None for stage in stages[1:]):
            raise PipelineSplitError(f"Pipeline plan `{path}` gives a stage after the first no worker config")
        return plan
