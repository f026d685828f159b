"""What a pipeline's stages measured while serving, kept per host, so the next split uses it.

Design: a split made before anything ran can only estimate each device's speed and the first
stage's serving work. Once a replica has served, every stage computed the same batches, so the
seconds each spent in its own layers per layer and step compare the devices directly, and the
time its thread was busy outside them is what it does per step besides. The first stage writes
these figures (`PipelineTiming`) to a per-host file keyed by the model and the set of devices
(a simulated device's key carries its slowdown factor), at most every `RECORD_S` and when it
stops; the router's planner splits by them where one record covers every device of a replica
(`measured_inputs`). Trade-off: a record is of one model on one set of devices, averaged over
whatever batches the replica served; another set or a changed model falls back to the estimates,
and says so. The file is small JSON, replaced whole under a lock."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from workers.contract.slowdown import NONE, Slowdown

ENV_STAGE_TIMINGS = "HETSERVE_STAGE_TIMINGS"  # the file's path (default: ~/.cache/hetserve/stage_timings.json)
MIN_STEPS = 32  # a stage's figures count from this many steps on
RECORD_S = 30.0  # the first stage rewrites its record at most this often while serving


@dataclass(frozen=True)
class StageTiming:
    """One stage's figures: its device (`device_key`), its layers, and over `steps` steps the wall
    seconds of its layers and the wall seconds its thread was busy in all (its layers and its work
    besides, not its waits for the other stages or for work)."""

    device: str
    layers: int
    steps: int
    layer_seconds: float
    busy_seconds: float
    host_cpu: bool  # its layers compute on the host's CPU (a CPU or simulated device)

    @property
    def per_layer(self) -> float:
        """Seconds per layer and step: the inverse of its speed on this model."""
        return self.layer_seconds / max(1, self.steps * self.layers)

    @property
    def besides(self) -> float:
        """Seconds per step its thread was busy outside its layers (serving, transport)."""
        return max(0.0, self.busy_seconds - self.layer_seconds) / max(1, self.steps)


@dataclass(frozen=True)
class PipelineTiming:
    """One replica's stages, in stage order, measured together for model `model` (`model_key`)."""

    model: str
    stages: tuple[StageTiming, ...]
    measured_at: float

    @property
    def key(self) -> str:
        """Its key in the file: the model on this set of devices (`record_key`)."""
        return record_key(self.model, [s.device for s in self.stages])

    @property
    def steps(self) -> int:
        return min((s.steps for s in self.stages), default=0)

    def usable(self) -> bool:
        return len(self.stages) >= 2 and self.steps >= MIN_STEPS and all(s.per_layer > 0 for s in self.stages)

    def to_dict(self) -> dict:
        return {"model": self.model, "measured_at": self.measured_at, "stages": [asdict(s) for s in self.stages]}

    @classmethod
    def from_dict(cls, raw: Mapping) -> PipelineTiming:
        stages = tuple(StageTiming(str(s["device"]), int(s["layers"]), int(s["steps"]), float(s["layer_seconds"]),
                                   float(s["busy_seconds"]), bool(s["host_cpu"])) for s in raw["stages"])
        return cls(str(raw["model"]), stages, float(raw["measured_at"]))


def model_key(config_text: str, dtype: str, quantize: str) -> str:
    """The identity of a model as stages compute it: its config.json, the dtype and `--quantize` asked for."""
    digest = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    return f"{digest}/{dtype}/{quantize}"


def record_key(model: str, devices: Sequence[str]) -> str:
    """A record's key: the model (`model_key`) and its set of devices, in any order."""
    return f"{model} on {' + '.join(sorted(devices))}"


def device_key(uuid: str, simulated: bool, index: int, arch: str, slowdown: Slowdown = NONE) -> str:
    """A device's identity across runs: a real one's UUID; a simulated one's index and architecture,
    with its `$HETSERVE_SLOWDOWN` factors where it is slowed (then it is another device)."""
    if not simulated:
        return uuid
    return f"simulated {index} {arch}" + (f" slowed {slowdown.describe()}" if slowdown.slowed else "")


def timings_path(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    given = environ.get(ENV_STAGE_TIMINGS)
    return Path(given).expanduser() if given else Path.home() / ".cache" / "hetserve" / "stage_timings.json"


def read_timings(path: Path) -> dict[str, PipelineTiming]:
    """The latest record of every model on every set of devices in `path`, by `record_key`; {} when
    there is no file, and records that cannot be read are skipped (a file from another version must
    not stop a start: the split then estimates)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for value in (raw.get("records") or {}).values() if isinstance(raw, dict) else ():
        with contextlib.suppress(KeyError, TypeError, ValueError):
            timing = PipelineTiming.from_dict(value)
            out[timing.key] = timing
    return out


def record_timing(path: Path, timing: PipelineTiming) -> None:
    """Replace the record of `timing`'s model on its devices in `path`, under a lock, by writing a
    new file and renaming it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = {k: v.to_dict() for k, v in read_timings(path).items()}
        records[timing.key] = timing.to_dict()
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"records": records}, indent=1))
        os.replace(tmp, path)


@dataclass(frozen=True)
class MeasuredInputs:
    """What a record gives a split: each stage's speed (layers per second), the layer-times it is
    charged before any layer (its work besides them), and the reason."""

    speeds: tuple[float, ...]
    ahead: tuple[float, ...]
    reason: str


def measured_inputs(timing: PipelineTiming | None, devices: Sequence[str]) -> MeasuredInputs | None:
    """The split's inputs for a replica over `devices` (`device_key`s, in stage order) from `timing`,
    or None where it does not cover them all or holds too few steps. A stage is charged the work
    besides its layers that its role measured (the first stage's for the first, the others' mean
    for the rest), where it computes on the host's CPU; a GPU's layers run while the CPU works."""
    if timing is None or not timing.usable():
        return None
    by_device = {s.device: s for s in timing.stages}
    if len(devices) < 2 or any(d not in by_device for d in devices):
        return None
    first, rest = timing.stages[0].besides, [s.besides for s in timing.stages[1:]]
    others = sum(rest) / len(rest)
    speeds, ahead = [], []
    for i, d in enumerate(devices):
        s = by_device[d]
        speeds.append(1.0 / s.per_layer)
        ahead.append((first if i == 0 else others) / s.per_layer if s.host_cpu else 0.0)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(timing.measured_at))
    per = ", ".join(f"{by_device[d].per_layer * 1e3:.2f} ms" for d in devices)
    return MeasuredInputs(tuple(speeds), tuple(ahead),
                          f"speeds measured over {timing.steps} steps on {when} ({per} per layer and step)")
