"""The worker's whole configuration as one frozen value: the router writes it, the worker reads it.

Design: each field of `WorkerConfig` declares its type, default and help once (`field(metadata=
_flag(...))`). The router writes the value as JSON in its run directory and starts `python -m
workers --config FILE` (server/fleet/spec.py); a pipeline's plan carries each later stage's value
(workers/contract/pipeline.py). A worker started by hand keeps a command line, generated from the
same declarations (`argument_parser`, `from_argv`): one flag per field, its name the field's, its
default and help the field's, and flags given beside `--config` override the file's fields.
Validation runs once, in `__post_init__`, however the value was made; a JSON file with an unknown
key or a value of the wrong type is refused naming it. Two defaults come from the environment
when no file is given (`$HETSERVE_COMPILE`, `$HETSERVE_PREFLIGHT`): the router resolves them into
the file it writes, so a worker it starts reads nothing else. Trade-off: the fields are flat (one
flag each), so the grammar compile budget is four fields rather than one nested value
(`CompileBudget.from_config` in workers/sampling/grammar_sandbox.py makes its value).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from workers.contract.defaults import (
    COMPILE_MODES,
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_QUEUE,
    ENV_COMPILE,
    ENV_PREFLIGHT,
    KV_HOST_SHARE,
    PREFLIGHT_MODES,
    engine_limits_error,
)
from workers.contract.gguf_rule import GGUF_ACTIVATIONS, GGUF_EXACT
from workers.contract.limits import (
    GRAMMAR_CACHE_MIB,
    GRAMMAR_COMPILE_MEMORY_MIB,
    GRAMMAR_COMPILE_TIMEOUT_S,
    GRAMMAR_COMPILE_WORKERS,
    grammar_budget_error,
)
from workers.contract.slowdown import Slowdown
from workers.contract.speculative import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DEFAULT_SPECULATIVE,
    SPECULATIVE_MODES,
    speculative_error,
)

DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZE = ("none", "fp8")
PROG = "python -m workers"
DEFAULT_MAX_LORAS, DEFAULT_MAX_LORA_RANK = 8, 16  # SGLang's adapters per batch; vLLM's rank limit
CPU_LORAS_PER_SLOT = 4  # host copies kept per device slot unless --max-cpu-loras says otherwise


def parse_loras(spec: str | Sequence[str] | None) -> tuple[tuple[str, str], ...]:
    """`NAME=DIR` entries (a `,`-separated string, or each `--lora` given) as (name, directory)
    pairs; `ValueError` names a malformed or repeated entry."""
    items = [] if not spec else spec.split(",") if isinstance(spec, str) else list(spec)
    pairs: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path or any(c in name for c in " \t/,"):
            raise ValueError(f"`--lora {item}` is not `NAME=DIR`. Accepted: a name without spaces, `/` or `,`, "
                             f"`=`, and the adapter's directory (no `,` in it)")
        if name in pairs:
            raise ValueError(f"`--lora {name}=...` is given twice. Accepted: one directory per adapter name")
        pairs[name] = path
    return tuple(pairs.items())


class WorkerConfigError(ValueError):
    """A configuration that cannot run: the message names the field (as its flag) and its value."""


def _flag(help: str, *, choices: Sequence[str] | None = None, metavar: str | None = None, env: str | None = None,
          what: str = "value") -> dict:
    """A field's command-line declaration: its help, accepted values, and the environment variable
    whose value is its default when no `--config` is given (`what` names it in that refusal)."""
    return {"help": help, "choices": tuple(choices) if choices else None, "metavar": metavar, "env": env,
            "what": what}


@dataclass(frozen=True)
class WorkerConfig:
    """One worker's configuration (`python -m workers --help` lists each field as its flag)."""

    socket: str = field(metadata=_flag("Unix socket path to listen on (created with mode 0600)"))
    worker_id: str | None = field(default=None, metadata=_flag(
        "name in logs, headers and /capability (default: worker-<device index>)"))
    model: str | None = field(default=None, metadata=_flag("HF-layout model directory (default: the embedded model)"))
    simulate: str | None = field(default=None, metadata=_flag("simulated device token, e.g. sm_89, gfx942, cpu"))
    device_index: int | None = field(default=None, metadata=_flag(
        "physical device index (default: $HETSERVE_DEVICE_INDEX or 0)"))
    device_uuid: str | None = field(default=None, metadata=_flag("device UUID to check after binding"))
    dtype: str = field(default="auto", metadata=_flag("the model's compute dtype", choices=DTYPES))
    quantize: str = field(default="none", metadata=_flag("fp8: quantize the weights at load", choices=QUANTIZE))
    gguf_activations: str = field(default=GGUF_EXACT, metadata=_flag(
        "a GGUF file's packed blocks on the CPU: exact activations, or int8: the decode GEMV rounds them to 8 bits "
        "per 256 inputs as llama.cpp does (faster; logits no longer within 1e-4 of transformers')",
        choices=GGUF_ACTIVATIONS))
    max_batch: int = field(default=DEFAULT_MAX_BATCH, metadata=_flag("most sequences running at once"))
    max_queue: int = field(default=DEFAULT_MAX_QUEUE, metadata=_flag("requests waiting beyond the batch before 429"))
    kv_cache_bytes: int | None = field(default=None, metadata=_flag(
        "KV cache budget (default: 85% of free GPU memory; on CPU --max-batch full-context sequences, at most "
        "512 MiB)"))
    max_model_len: int | None = field(default=None, metadata=_flag(
        "longest sequence served: the context is capped at it (default: the checkpoint's)"))
    gpu_memory_utilization: float | None = field(default=None, metadata=_flag(
        "fraction of the device's own memory for weights and KV cache (0 < F <= 1; on a simulated device, of "
        "its simulated memory); see workers/kv/sizing.py"))
    kv_host_bytes: int | None = field(default=None, metadata=_flag(
        f"host-memory KV tier budget in bytes, shared by the host's workers of the same model and KV format "
        f"(default: {KV_HOST_SHARE:.0%} of MemAvailable at start; 0: no tier); see workers/kvtier/",
        metavar="N"))
    kv_host_dir: str | None = field(default=None, metadata=_flag(
        "the host KV tier's directory (the router makes one under /dev/shm per run; none: no tier)",
        metavar="DIR"))
    kv_block_size: int = field(default=DEFAULT_KV_BLOCK_SIZE, metadata=_flag(
        f"tokens per KV cache block (default {DEFAULT_KV_BLOCK_SIZE})"))
    no_prefix_cache: bool = field(default=False, metadata=_flag(
        "do not reuse the KV blocks of shared prompt prefixes"))
    max_num_batched_tokens: int | None = field(default=None, metadata=_flag(
        f"tokens one engine step computes: decodes first, then prompt chunks (default "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} on a GPU, {CPU_MAX_NUM_BATCHED_TOKENS} where the step computes on the "
        f"CPU: a CPU or simulated device)"))
    deterministic: bool = field(default=False, metadata=_flag(
        "batch-invariant numerics: a request's output does not depend on its batch mates (fixed GEMM row tiles "
        "and attention splits; see workers/model/deterministic.py)"))
    compile: str = field(default="auto", metadata=_flag(
        f"the decode step compiled per batch bucket (Inductor on CPU, CUDA/HIP graphs on GPUs): auto (real GPUs "
        f"and CPU workers, not simulated GPUs), on, off (default: ${ENV_COMPILE} or auto); see "
        f"workers/engine/compiled.py", env=ENV_COMPILE))
    speculative: str = field(default=DEFAULT_SPECULATIVE, metadata=_flag(
        f"speculative decoding: {', '.join(SPECULATIVE_MODES)} (auto: suffix-tree drafts where the engine can "
        f"verify them and greedy output stays exact, k chosen per step from the measured step costs; see "
        f"workers/engine/speculate.py)", metavar="|".join(SPECULATIVE_MODES)))
    num_speculative_tokens: int = field(default=DEFAULT_NUM_SPECULATIVE_TOKENS, metadata=_flag(
        "most draft tokens a decode row carries per step", metavar="N"))
    threads: int | None = field(default=None, metadata=_flag("torch intra-op threads (default: torch's choice)"))
    status_file: str | None = field(default=None, metadata=_flag(
        "JSON status file, rewritten atomically at each step"))
    parent_pid: int | None = field(default=None, metadata=_flag("exit when this process dies"))
    otlp_endpoint: str | None = field(default=None, metadata=_flag(
        "export OpenTelemetry spans (OTLP) to this collector", metavar="URL"))
    grammar_compile_timeout: float = field(default=GRAMMAR_COMPILE_TIMEOUT_S, metadata=_flag(
        "wall-clock seconds one grammar may take to compile (then 422)", metavar="S"))
    grammar_compile_memory_mib: int = field(default=GRAMMAR_COMPILE_MEMORY_MIB, metadata=_flag(
        "MiB one grammar compile may use in its sandbox process (then 422)", metavar="N"))
    grammar_compile_workers: int = field(default=GRAMMAR_COMPILE_WORKERS, metadata=_flag(
        "grammar compiles at once", metavar="N"))
    grammar_cache_mib: int = field(default=GRAMMAR_CACHE_MIB, metadata=_flag(
        "MiB of compiled grammars kept", metavar="N"))
    pipeline_plan: str | None = field(default=None, metadata=_flag(
        "serve as a stage of this pipeline plan (written by the router; workers/pipeline/)", metavar="FILE"))
    pipeline_rank: int = field(default=0, metadata=_flag(
        "this worker's stage in --pipeline-plan (0: the first, which starts the others)"))
    pipeline_batches: int | None = field(default=None, metadata=_flag(
        "batches in flight through a pipeline at once, each of its own sequences (default: one per stage; 1: "
        "one step at a time; see workers/pipeline/engine.py)"))
    pipeline_microbatches: int | None = field(default=None, metadata=_flag(
        "micro-batches each step of a pipeline is cut into (default 1)"))
    preflight: str = field(default="auto", metadata=_flag(
        f"compile and check the selected kernels before ready: auto (real GPUs), on (simulated GPUs too), off "
        f"(default: ${ENV_PREFLIGHT} or auto)", choices=PREFLIGHT_MODES, env=ENV_PREFLIGHT, what="preflight mode"))
    lora: str | None = field(default=None, metadata=_flag(
        "LoRA adapters over the model, `NAME=DIR` as PEFT writes them, several separated by `,`", metavar="NAME=DIR"))
    max_loras: int = field(default=DEFAULT_MAX_LORAS, metadata=_flag(
        "LoRA adapters held in memory at once (the least recently used idle one leaves for another)"))
    max_lora_rank: int = field(default=DEFAULT_MAX_LORA_RANK, metadata=_flag("the highest LoRA rank accepted"))
    max_cpu_loras: int | None = field(default=None, metadata=_flag(
        "LoRA adapters whose host-memory copies are kept (an evicted one comes back from there, not from disk); "
        "at least --max-loras, default 4x it", metavar="N"))
    slowdown: float = field(default=1.0, metadata=_flag(
        "a simulated device only: every forward pass takes this many times as long (benchmarks and tests; the "
        "router sets it from $HETSERVE_SLOWDOWN, workers/device/slowdown.py)", metavar="F"))
    prefill_slowdown: float | None = field(default=None, metadata=_flag(
        "a simulated device only: its prefill tokens take this many times as long instead (a card slower at "
        "compute than at bandwidth; default: --slowdown)", metavar="F"))

    @property
    def slowdowns(self) -> Slowdown:
        """The simulated device's factors per phase (workers/device/slowdown.py)."""
        prefill = self.slowdown if self.prefill_slowdown is None else self.prefill_slowdown
        return Slowdown(prefill, self.slowdown, "its configuration")

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _typed(f.name, getattr(self, f.name)))
        error = self._error()
        if error is not None:
            raise WorkerConfigError(error)

    def _error(self) -> str | None:
        """Why these values cannot run together, or None: every check the command line had."""
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices and value not in choices:
                return f"`{_flag_name(f.name)} {value}` is not accepted. Accepted: {', '.join(choices)}"
        for name in ("max_batch", "threads", "kv_cache_bytes", "max_model_len", "pipeline_microbatches",
                     "pipeline_batches"):
            value = getattr(self, name)
            if value is not None and value < 1:
                return f"`{_flag_name(name)}` must be >= 1, got `{value}`"
        fraction = self.gpu_memory_utilization
        if fraction is not None and not 0 < fraction <= 1:
            return f"`--gpu-memory-utilization {fraction}` is no fraction. Accepted: 0 < F <= 1"
        if self.kv_host_bytes is not None and self.kv_host_bytes < 0:
            return f"`--kv-host-bytes` must be >= 0 (0: no host tier), got `{self.kv_host_bytes}`"
        if self.max_queue < 0:
            return f"`--max-queue` must be >= 0, got `{self.max_queue}`"
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                return f"`{_flag_name(name)}` must be >= 1, got `{getattr(self, name)}`"
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            return f"`--max-cpu-loras` must be >= `--max-loras` ({self.max_loras}), got `{self.max_cpu_loras}`"
        try:
            parse_loras(self.lora)
        except ValueError as e:
            return str(e)
        if self.pipeline_rank < 0:
            return f"`--pipeline-rank` must be >= 0, got `{self.pipeline_rank}`"
        for flag, factor in (("--slowdown", self.slowdown), ("--prefill-slowdown", self.prefill_slowdown)):
            if factor is not None and not (factor >= 1.0 and math.isfinite(factor)):
                return f"`{flag} {factor}` is no slowdown factor. Accepted: a number >= 1"
        error = engine_limits_error(self.kv_block_size, self.max_num_batched_tokens, self.max_batch)
        if error:
            return error
        if self.compile not in COMPILE_MODES:
            return (f"`--compile {self.compile}` is not a mode (or `${ENV_COMPILE}`). "
                    f"Accepted: {', '.join(COMPILE_MODES)}")
        error = speculative_error(self.speculative, self.num_speculative_tokens)
        if error:
            return error
        return grammar_budget_error(self.grammar_compile_timeout, self.grammar_compile_memory_mib,
                                    self.grammar_compile_workers, self.grammar_cache_mib)

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping) -> WorkerConfig:
        """The value a JSON object describes; `WorkerConfigError` names an unknown key, a missing
        one or a value of the wrong type."""
        if not isinstance(raw, Mapping):
            raise WorkerConfigError(f"A worker config is a JSON object, not `{type(raw).__name__}`")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise WorkerConfigError(f"Unknown worker config key `{unknown[0]}`. Accepted: {', '.join(sorted(known))}")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in raw]
        if missing:
            raise WorkerConfigError(f"The worker config lacks `{missing[0]}`")
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise WorkerConfigError(f"A worker config is JSON: {e}") from e
        return cls.from_dict(raw)

    def write(self, path: str | Path) -> Path:
        """Write the value to `path` (through a temporary file and a rename: a reader never sees half)."""
        path = Path(path)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> WorkerConfig:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise WorkerConfigError(f"Worker config `{path}` cannot be read: {e.strerror or e}") from e
        try:
            return cls.from_json(text)
        except WorkerConfigError as e:
            raise WorkerConfigError(f"Worker config `{path}`: {e}") from e

    # ---- the command line ----------------------------------------------------------------
    def to_argv(self) -> list[str]:
        """The flags that give this value (`from_argv` reads them back to it): each field that
        differs from its default, and those whose default the environment may change."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or (value == f.default and not f.metadata["env"]):
                continue
            if isinstance(value, bool):
                argv += [_flag_name(f.name)] if value else []
            else:
                argv += [_flag_name(f.name), str(value)]
        return argv

    @classmethod
    def from_argv(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerConfig:
        """The value of a worker's command line: `--config FILE`, then the flags given (which
        override the file's fields); without a file, the environment's defaults (`$HETSERVE_COMPILE`,
        `$HETSERVE_PREFLIGHT`). A bad flag exits 2 naming it, as argparse does."""
        environ = os.environ if environ is None else environ
        parser = argument_parser()
        args = parser.parse_args(argv)
        given = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
        try:
            values = {**WorkerConfig.read(args.config).to_dict(), **given} if args.config else given
            if not args.config:
                for f in fields(cls):
                    env = f.metadata["env"]
                    if env and f.name not in values and environ.get(env):
                        values[f.name] = _from_environment(f, env, environ[env])
                if "socket" not in values:
                    parser.error("the following arguments are required: --socket (or --config)")
            return cls(**values)
        except WorkerConfigError as e:
            parser.error(str(e))


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _from_environment(f, env: str, value: str) -> str:
    if f.metadata["choices"] and value not in f.metadata["choices"]:  # argparse checks only what is given
        raise WorkerConfigError(f"`${env}={value}` is not a {f.metadata['what']}. Accepted: "
                                f"{', '.join(f.metadata['choices'])}")
    return value


def argument_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """`python -m workers`'s flags, one per `WorkerConfig` field (defaults None: a flag not
    given leaves the file's value, or the field's default), and `--config FILE`."""
    p = argparse.ArgumentParser(prog=prog, description="hetserve worker: serve one device.")
    p.add_argument("--config", metavar="FILE",
                   help="the worker's configuration as JSON (what the router writes); flags given beside it "
                        "override its fields")
    for f in fields(WorkerConfig):
        meta, (kind, _) = f.metadata, _HINTS[f.name]
        text = meta["help"].replace("%", "%%")
        if kind is bool:
            p.add_argument(_flag_name(f.name), action="store_true", default=None, help=text)
        else:
            p.add_argument(_flag_name(f.name), type=kind, default=None, choices=meta["choices"],
                           metavar=meta["metavar"], help=text)
    return p


def _hint(annotation) -> tuple[type, bool]:
    """(the value's type, whether None is allowed) of a field's annotation (`int`, `str | None`)."""
    if isinstance(annotation, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0], True
    return annotation, False


_HINTS = {name: _hint(hint) for name, hint in typing.get_type_hints(WorkerConfig).items()}


def _typed(name: str, value):
    """`value` as field `name` holds it (an int where a float is declared becomes that float);
    `WorkerConfigError` for a value of another type."""
    kind, optional = _HINTS[name]
    if value is None and optional:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    shown = "null" if value is None else json.dumps(value) if isinstance(value, (str, int, float, bool)) else \
        type(value).__name__
    raise WorkerConfigError(f"Worker config `{name}` must be {kind.__name__}{' or null' if optional else ''}, "
                            f"got `{shown}`")
