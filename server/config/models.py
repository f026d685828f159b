"""Which models one `hetserve serve` offers, where they are pinned, and which are loaded on demand:
`--model [NAME=]DIR`, `--models-dir`, `--place`, `--max-loaded-models`, `--pin-model`,
`--model-min-residence-s`, `--served-model-name` (docs/serving.md says what each does).

Design: validated once into a frozen `ModelsConfig`, every error naming the bad value and what
is accepted, so the fleet and the edge read plain values. The first model is the default. A name
is what clients send as the OpenAI `model` and what URLs carry: letters, digits and `._:-`.
Trade-off: `NAME=DIR` is told from a bare `DIR` by an `=` with no `/` before it, unless the
whole value is an existing path: a directory whose name holds `=` is found as it is."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from server.config.gguf import is_gguf_path, prepare_gguf
from server.errors import UsageError, shown
from workers.contract import DEFAULT_MODEL_DIR
from workers.contract.gguf_rule import GGUF_ACTIVATIONS, GGUF_EXACT

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
ACCEPTED_NAMES = "1-128 letters, digits and `._:-`, starting with a letter or digit"
CONFIG_FILE = "config.json"
# A model loaded (on demand or at start) is not unloaded to make room for another before this many
# seconds: alternating requests for two models then cost one worker start per residence, not per request.
DEFAULT_MIN_RESIDENCE_S = 30.0


@dataclass(frozen=True)
class ModelEntry:
    """One model offered: the name clients ask for and its Hugging Face directory."""

    name: str
    path: Path


@dataclass(frozen=True)
class ModelsConfig:
    """The models of one run (see the module docstring); empty `entries`: the embedded model."""

    entries: tuple[ModelEntry, ...] = ()
    place: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (model, device tokens) from --place
    pinned: tuple[str, ...] = ()  # --pin-model: always loaded
    max_loaded: int | None = None  # --max-loaded-models
    models_dir: Path | None = None
    pipeline: int | None = None  # --pipeline N: stages per replica; None: auto (only a model no device holds)
    partition: tuple[int, ...] | None = None  # --pipeline-partition: layers per stage
    min_residence_s: float = DEFAULT_MIN_RESIDENCE_S  # --model-min-residence-s: no eviction before this

    @property
    def on_demand(self) -> bool:
        """Models load when first asked for, and the least recently used unload for room."""
        return self.models_dir is not None or self.max_loaded is not None

    def catalog(self, default_dir: Path = DEFAULT_MODEL_DIR) -> tuple[ModelEntry, ...]:
        """Every model offered, the default first (the embedded model when none was named)."""
        return self.entries or (ModelEntry(default_dir.name, default_dir),)

    def pins_of(self, name: str) -> tuple[str, ...]:
        return dict(self.place).get(name, ())


def add_model_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("model", "what is served: the checkpoints, their names and dtype, their placement "
                                          "on the devices, loading on demand")
    g.add_argument("--model", metavar="[NAME=]DIR", action="append", default=None,
                   help="a Hugging Face model directory or a GGUF file (split parts: any part; or their directory), "
                        "optionally named (repeatable; a bare DIR takes the directory's name, a GGUF its file's; the "
                        "first is the default; none: the embedded model)")
    g.add_argument("--models-dir", metavar="DIR", default=None,
                   help="offer every model directory below DIR (each named by its directory) and load them on "
                        "demand")
    g.add_argument("--place", metavar="NAME=DEV[,DEV...]", action="append", default=None,
                   help="pin a model's replicas to these devices (worker id gpu0, index or UUID; `gpu0+gpu2` joins "
                        "devices into one pipeline replica, `,` separates replicas); repeatable")
    g.add_argument("--pipeline", metavar="auto|N", default="auto",
                   help="split a model's layers over N devices per replica (default auto: only a model that fits no "
                        "single device, over the fewest that hold it), by each device's memory and speed")
    g.add_argument("--pipeline-partition", metavar="N,N[,N...]", default=None,
                   help="the layers of each pipeline stage, in order (default: by memory and speed)")
    g.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                   help="load at most N models at once: a request for another loads it, unloading the least "
                        "recently used")
    g.add_argument("--model-min-residence-s", type=float, default=None, metavar="S",
                   help=f"a loaded model is not unloaded to make room for another before S seconds (default "
                        f"{DEFAULT_MIN_RESIDENCE_S:g}); a request that would need it gets 503 with Retry-After")
    g.add_argument("--pin-model", metavar="NAME", action="append", default=None,
                   help="keep this model always loaded (repeatable)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="the dtype weights and activations compute in (default auto: the checkpoint's where the "
                        "device computes it well; float16 for bfloat16 below sm_80, float32 for float16 on a CPU)")
    g.add_argument("--quantize", default="none", choices=["none", "fp8"],
                   help="fp8: quantize the projections to fp8 e4m3 at load, in each device's own fp8 convention "
                        "(default none: a pre-quantized checkpoint runs as stored)")
    g.add_argument("--gguf-activations", default=GGUF_EXACT, choices=GGUF_ACTIVATIONS,
                   help="a GGUF file's packed blocks on a CPU worker: exact activations (default), or int8: the "
                        "decode GEMV rounds them to 8 bits per 256 inputs as llama.cpp does (faster on the CPU; "
                        "logits no longer within 1e-4 of transformers')")
    g.add_argument("--served-model-name", metavar="NAME", default=None,
                   help="the name clients see (/v1/models, responses' `model`, metrics labels) for the model of a "
                        "bare --model DIR or the embedded model (default: the directory's name)")


def _is_named(value: str) -> bool:
    """`NAME=DIR` rather than a bare `DIR` (the module docstring's trade-off)."""
    name, sep, _ = value.partition("=")
    return bool(sep) and "/" not in name and not Path(value).expanduser().exists()


def parse_model_arg(value: str) -> ModelEntry:
    """`chat=/data/llama` -> (chat, /data/llama); `/data/llama` -> (llama, /data/llama)."""
    name, _, rest = value.partition("=")
    if _is_named(value):
        if not NAME_RE.match(name):
            raise UsageError(f"`--model {shown(value)}`: `{shown(name)}` is no model name ({ACCEPTED_NAMES})")
        path = Path(rest).expanduser()
    else:
        path, name = Path(value).expanduser(), Path(value).expanduser().resolve().name
        if not NAME_RE.match(name):
            raise UsageError(f"`--model {shown(value)}`: the directory's name `{shown(name)}` is no model name "
                             f"({ACCEPTED_NAMES}); name it: `--model NAME={shown(value)}`")
    if is_gguf_path(path):  # a GGUF file, split part or directory: served from its prepared directory
        directory, stem = prepare_gguf(path)
        if not _is_named(value) and not NAME_RE.match(stem):
            raise UsageError(f"`--model {shown(value)}`: the file's name `{shown(stem)}` is no model name "
                             f"({ACCEPTED_NAMES}); name it: `--model NAME={shown(value)}`")
        return ModelEntry(name if _is_named(value) else stem, directory)
    if not path.is_dir():
        raise UsageError(f"Model directory `{shown(str(path))}` does not exist. Pass a Hugging Face model directory "
                         "or a GGUF file, or omit --model")
    return ModelEntry(name, path.resolve())


def scan_models_dir(root: str) -> tuple[ModelEntry, ...]:
    """Every subdirectory of `root` with a config.json, by name."""
    base = Path(root).expanduser()
    if not base.is_dir():
        raise UsageError(f"`--models-dir {shown(root)}` is not a directory")
    found = []
    for sub in sorted(p for p in base.iterdir() if p.is_dir() and (p / CONFIG_FILE).is_file()):
        if not NAME_RE.match(sub.name):
            raise UsageError(f"`--models-dir {shown(root)}`: `{shown(sub.name)}` is no model name ({ACCEPTED_NAMES}); "
                             "rename the directory")
        found.append(ModelEntry(sub.name, sub.resolve()))
    return tuple(found)


def _parse_place(values: list[str], names: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    out: dict[str, tuple[str, ...]] = {}
    for value in values:
        name, sep, devices = value.partition("=")
        tokens = tuple(t.strip() for t in devices.split(","))
        if not sep or not devices.strip() or any(not t for t in tokens):
            raise UsageError(f"`--place {shown(value)}`: write NAME=DEV[,DEV...], a device by worker id (gpu0), "
                             "index or UUID, e.g. `--place chat=gpu0,gpu2`")
        if any(not part.strip() for t in tokens for part in t.split("+")):
            raise UsageError(f"`--place {shown(value)}`: `+` joins devices into one pipeline replica, e.g. "
                             "`--place big=gpu0+gpu2`")
        if name not in names:
            raise UsageError(f"`--place {shown(value)}`: no model `{shown(name)}`. Models: {', '.join(names)}")
        if name in out:
            raise UsageError(f"`--place {name}=...` is given twice; list all of its devices in one")
        out[name] = tokens
    return tuple(out.items())


def models_from_args(args) -> ModelsConfig:
    """`--model`, `--models-dir`, `--place`, `--max-loaded-models`, `--pin-model`, checked."""
    raw = getattr(args, "model", None) or []
    if isinstance(raw, str):  # a namespace built by hand with one model
        raw = [raw]
    models_dir = getattr(args, "models_dir", None)
    entries = _served_name([parse_model_arg(v) for v in raw], raw, getattr(args, "served_model_name", None),
                           models_dir)
    if models_dir is not None:
        scanned = scan_models_dir(models_dir)
        if not scanned and not entries:
            raise UsageError(f"`--models-dir {shown(models_dir)}` holds no model directory (a subdirectory with a "
                             f"{CONFIG_FILE})")
        entries += [e for e in scanned if e.name not in {x.name for x in entries}]
    names = tuple(e.name for e in entries) or (DEFAULT_MODEL_DIR.name,)
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise UsageError(f"Model name `{e.name}` is given twice; name each model once (`--model NAME=DIR`)")
        seen.add(e.name)
    pinned = tuple(dict.fromkeys(getattr(args, "pin_model", None) or ()))
    for name in pinned:
        if name not in names:
            raise UsageError(f"`--pin-model {shown(name)}`: no model `{shown(name)}`. Models: {', '.join(names)}")
    max_loaded = getattr(args, "max_loaded_models", None)
    if max_loaded is not None and max_loaded < max(1, len(pinned)):
        raise UsageError(f"`--max-loaded-models {max_loaded}` must be at least 1 and at least the "
                         f"{len(pinned)} pinned models (--pin-model)")
    residence = getattr(args, "model_min_residence_s", None)
    residence = DEFAULT_MIN_RESIDENCE_S if residence is None else residence
    if not 0 <= residence < float("inf"):
        raise UsageError(f"`--model-min-residence-s {residence}` is no duration. Accepted: seconds >= 0 (0: a model "
                         f"may be unloaded as soon as it is loaded)")
    stages, partition = _pipeline_flags(getattr(args, "pipeline", "auto"), getattr(args, "pipeline_partition", None))
    return ModelsConfig(tuple(entries), _parse_place(getattr(args, "place", None) or [], names), pinned, max_loaded,
                        None if models_dir is None else Path(models_dir).expanduser().resolve(), stages, partition,
                        float(residence))


def _pipeline_flags(pipeline: str | None, partition: str | None) -> tuple[int | None, tuple[int, ...] | None]:
    """`--pipeline auto|N` and `--pipeline-partition N,N`, checked against each other."""
    from workers.contract.pipeline import PipelineSplitError, parse_partition

    stages = None
    if pipeline not in (None, "auto"):
        try:
            stages = int(pipeline)
        except ValueError:
            stages = 0
        if stages < 1:
            raise UsageError(f"`--pipeline {shown(str(pipeline))}` is not a stage count. Accepted: auto, or an "
                             f"integer >= 1 (1: no pipeline)")
    counts = None
    if partition is not None:
        try:
            counts = parse_partition(partition)
        except PipelineSplitError as e:
            raise UsageError(str(e)) from e
        if stages is not None and stages != len(counts):
            raise UsageError(f"`--pipeline-partition {partition}` gives {len(counts)} stages; `--pipeline {stages}` "
                             f"asks for {stages}")
    return stages, counts


def _served_name(entries: list[ModelEntry], raw: list[str], served: str | None,
                 models_dir: str | None) -> list[ModelEntry]:
    """`--served-model-name NAME` applied to the one bare `--model DIR` (or the embedded model)."""
    if served is None:
        return entries
    if not NAME_RE.match(served):
        raise UsageError(f"`--served-model-name {shown(served)}` is no model name ({ACCEPTED_NAMES})")
    if not raw and models_dir is not None:
        raise UsageError(f"`--served-model-name {shown(served)}` names the model of a bare `--model DIR`; "
                         f"`--models-dir {shown(models_dir)}` names each model by its directory")
    if not raw:  # the embedded model, under the name asked for
        return [ModelEntry(served, DEFAULT_MODEL_DIR)]
    bare = [i for i, value in enumerate(raw) if not _is_named(value)]
    if len(bare) != 1:
        given = ", ".join(f"`--model {shown(v)}`" for v in raw)
        raise UsageError(f"`--served-model-name {shown(served)}` names the one model given as a bare `--model DIR`; "
                         f"{given} holds {len(bare)}. Name each model with `--model NAME=DIR` instead")
    out = list(entries)
    out[bare[0]] = ModelEntry(served, entries[bare[0]].path)
    return out
