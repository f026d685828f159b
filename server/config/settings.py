"""The router's settings: one frozen value built from `hetserve serve` arguments.

Everything the supervisor, the routing filter and the HTTP edge need to know about the run lives
here, so each of them is a plain function of (settings, workers) and tests can build one
without a command line. Timeouts are bounded everywhere: a request never waits forever for
a worker and a shutdown never waits forever for a request.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from server.config.api_key import resolve_api_key
from server.config.budgets import RequestBudgets, budgets_from_args
from server.config.compile import AUTO as AUTO_COMPILE
from server.config.compile import compile_from_args
from server.config.disaggregate import DisaggregateConfig, disaggregate_from_args
from server.config.loras import LorasConfig, loras_from_args
from server.config.memory import gpu_memory_utilization_from_args, max_model_len_from_args
from server.config.models import ModelsConfig, models_from_args
from server.config.protocol import ProtocolConfig, protocol_from_args
from server.config.reasoning import AUTO as AUTO_REASONING
from server.config.reasoning import reasoning_parser_from_args
from server.config.routing import RoutingConfig, routing_from_args
from server.config.speculative import SpeculativeConfig, speculative_from_args
from server.errors import UsageError
from workers.contract import (
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MODEL_DIR,
    DRAIN_TIMEOUT_S,
    engine_limits_error,
)
from workers.contract.checkpoint_check import CheckpointError, check_checkpoint
from workers.contract.tracing import check_endpoint

# Runs the worker under another command (a wrapper, a profiler, a test double):
# `HETSERVE_WORKER_CMD="python path/to/worker.py"`. Default: `<this python> -m workers`.
WORKER_CMD_ENV = "HETSERVE_WORKER_CMD"

HEADER_TIMEOUT_S = 10.0  # a request head (request line and headers) must arrive within this
BODY_TIMEOUT_S = 30.0  # a request body may pause this long between bytes

# The canary (server/canary/monitor.py): what it does with a worker whose numerics it finds suspect.
CANARY_ACTIONS = ("mark", "drain")
# The least agreement with the reference a healthy worker is expected to keep when its numerics
# may differ (another architecture, fp8 convention or dtype, or batching without
# --deterministic); the README's "Canary" section gives the measurements behind it.
CANARY_MIN_AGREEMENT = 0.9


def _default_worker_command() -> tuple[str, ...]:
    raw = os.environ.get(WORKER_CMD_ENV, "").strip()
    if raw:
        return tuple(shlex.split(raw))
    return (sys.executable, "-m", "workers")


def check_models(models: ModelsConfig) -> None:
    """`UsageError` of one line for the first model whose config.json the workers' registries refuse
    (workers/contract/checkpoint_check.py): the router finds it before binding the port."""
    for entry in models.entries:
        try:
            check_checkpoint(entry.path)
        except CheckpointError as e:
            scanned = models.models_dir is not None and entry.path.parent == Path(models.models_dir).resolve()
            flag = f"--models-dir {models.models_dir}` holds `{entry.name}" if scanned else f"--model {entry.path}"
            raise UsageError(f"`{flag}`: {e}") from e


@dataclass(frozen=True)
class RouterSettings:
    """What one `hetserve serve` run was asked for (see `from_args`)."""

    model_dir: Path = DEFAULT_MODEL_DIR  # the default model's (the first of `models`)
    models: ModelsConfig = field(default_factory=ModelsConfig)  # every model offered, pins, on demand
    loras: LorasConfig = field(default_factory=LorasConfig)  # LoRA adapters over the default model
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    quantize: str = "none"
    gguf_activations: str = "exact"  # --gguf-activations: a GGUF file's CPU GEMV rounds a decode's rows (int8)
    max_batch: int = DEFAULT_MAX_BATCH  # running sequences per worker
    max_queue: int = DEFAULT_MAX_QUEUE  # waiting requests per worker before it answers 429
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE  # tokens per KV cache block
    prefix_cache: bool = True  # workers reuse the KV blocks of shared prompt prefixes
    max_num_batched_tokens: int | None = None  # tokens per engine step (None: each device's, `step_token_budget`)
    api_key: str | None = None
    api_key_source: str = "none"  # --api-key, --api-key-file PATH, $HETSERVE_API_KEY or none
    # `POST /models/NAME/load|unload` without an API key: refused (403) unless this is set
    allow_unauthenticated_control: bool = False
    log_level: str = "info"
    special_tokens_in_content: bool = False  # chat content may hold the model's special tokens
    reasoning_parser: str = AUTO_REASONING  # auto | qwen3 | none (server/config/reasoning.py)
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)  # tool calls, task, lenient params
    # HTTP edge
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    header_timeout_s: float = HEADER_TIMEOUT_S  # a request head must arrive within this (408)
    body_timeout_s: float = BODY_TIMEOUT_S  # longest pause inside a request body (408)
    # write timeout, grammar compiles (server/config/budgets.py)
    budgets: RequestBudgets = field(default_factory=RequestBudgets)
    retry_after_s: int = 1  # `Retry-After` on 429 and 503
    ready_wait_s: float = 30.0  # how long a request waits for a ready worker (none ready yet)
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # in-flight requests get this long after SIGTERM
    # supervisor
    worker_command: tuple[str, ...] = field(default_factory=_default_worker_command)
    worker_stop_timeout_s: float = 15.0  # SIGTERM -> SIGKILL
    startup_timeout_s: float = 900.0  # a worker not ready by then is killed and restarted
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0  # a /health probe unanswered this long means the worker hangs
    stall_timeout_s: float = 30.0  # pending work and no engine step this long means the worker hangs
    hang_kill_grace_s: float = 5.0  # a hung worker gets SIGTERM, then SIGKILL after this
    unhealthy_after_failures: int = 3  # consecutive failed health checks
    unhealthy_kill_after_s: float = 60.0  # an unhealthy (hung) worker is killed and restarted
    restart_backoff_initial_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    max_startup_crashes: int = 5  # crashes in a row before ever becoming ready -> `failed`
    kv_cache_bytes: int | None = None
    kv_host_bytes: int | None = None  # --kv-host-bytes: the host KV tier's budget (None: the workers' default; 0: off)
    max_model_len: int | None = None  # --max-model-len: workers cap their context at it (server/config/memory.py)
    gpu_memory_utilization: float | None = None  # --gpu-memory-utilization: of each device's own memory
    threads: int | None = None  # CPU threads for all workers together (default: this process's CPUs)
    otlp_endpoint: str | None = None  # OpenTelemetry collector for router and worker spans (off when None)
    stats_interval_s: float = 2.0  # how often the status page's per-worker samples are taken
    # failures
    migration_limit: int = 3  # times one stream may move to another worker after losing its own
    breaker_failures: int = 5  # consecutive failed requests that open a worker's circuit breaker
    breaker_cooldown_s: float = 10.0  # an open breaker lets one probe request through after this
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # --routing and its parameters
    # --disaggregate, --prefill, --decode: prefill and decode roles (server/config/disaggregate.py)
    disaggregate: DisaggregateConfig = field(default_factory=DisaggregateConfig)
    # numerics
    deterministic: bool = False  # workers run batch-invariant numerics (workers/model/deterministic.py)
    compile: str = AUTO_COMPILE  # auto | on | off: workers' decode step compiled (server/config/compile.py)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # server/config/speculative.py
    canary_interval_s: float = 300.0  # seconds between canary rounds; 0 turns the canary off
    canary_min_agreement: float = CANARY_MIN_AGREEMENT  # below it (where not exact), a worker is suspect
    canary_action: str = "mark"  # mark | drain (out of rotation, restarted, checked again)

    @property
    def model_name(self) -> str:
        """The default model's name as clients see it (`--served-model-name`, else its directory's)."""
        return self.models.entries[0].name if self.models.entries else self.model_dir.name

    @property
    def worker_capacity(self) -> int:
        """Requests one worker accepts at once (running + queued); beyond it the router answers 429."""
        return self.max_batch + self.max_queue

    @classmethod
    def from_args(cls, args) -> RouterSettings:
        """Validate `hetserve serve` arguments (argparse namespace) into settings."""
        models = models_from_args(args)  # --model NAME=DIR, --models-dir, --place, ... (server/config/models.py)
        check_models(models)  # an unsupported checkpoint: one line, before any worker starts
        model_dir = models.catalog()[0].path  # the default model
        for name in ("max_batch", "max_queue"):
            value = getattr(args, name, None)
            if value is not None and value < 1:
                raise UsageError(f"`--{name.replace('_', '-')} {value}` must be at least 1")
        engine = {
            "kv_block_size": getattr(args, "kv_block_size", DEFAULT_KV_BLOCK_SIZE),
            "prefix_cache": not getattr(args, "no_prefix_cache", False),
            "max_num_batched_tokens": getattr(args, "max_num_batched_tokens", None),
        }
        error = engine_limits_error(engine["kv_block_size"], engine["max_num_batched_tokens"],
                                    getattr(args, "max_batch", DEFAULT_MAX_BATCH))
        if error:
            raise UsageError(error)
        port = getattr(args, "port", 8000)
        if not 0 <= port <= 65535:
            raise UsageError(f"`--port {port}` is out of range. Accepted: 0-65535 (0 picks a free port)")
        for name in ("header_timeout", "body_timeout"):
            value = getattr(args, name, None)
            if value is not None and not value > 0:
                raise UsageError(f"`--{name.replace('_', '-')} {value}` must be > 0 seconds")
        api_key, api_key_source = resolve_api_key(getattr(args, "api_key", None), getattr(args, "api_key_file", None))
        kwargs = {
            "model_dir": model_dir,
            "models": models,
            "loras": loras_from_args(args, models),
            "host": getattr(args, "host", "127.0.0.1"),
            "port": port,
            "dtype": getattr(args, "dtype", "auto"),
            "quantize": getattr(args, "quantize", "none"),
            "gguf_activations": getattr(args, "gguf_activations", "exact"),
            "max_batch": getattr(args, "max_batch", DEFAULT_MAX_BATCH),
            "max_queue": getattr(args, "max_queue", DEFAULT_MAX_QUEUE),
            **engine,
            "api_key": api_key,
            "api_key_source": api_key_source,
            "allow_unauthenticated_control": bool(getattr(args, "allow_unauthenticated_control", False)),
            "log_level": getattr(args, "log_level", "info"),
            "special_tokens_in_content": bool(getattr(args, "special_tokens_in_content", False)),
            "deterministic": bool(getattr(args, "deterministic", False)),
            "compile": compile_from_args(args),
            "speculative": speculative_from_args(args, [e.path for e in models.catalog()]),
            "reasoning_parser": reasoning_parser_from_args(args),
            "protocol": protocol_from_args(args),
            "max_model_len": max_model_len_from_args(args, models),
            "gpu_memory_utilization": gpu_memory_utilization_from_args(args),
        }
        endpoint = getattr(args, "otlp_endpoint", None)
        if endpoint:
            try:
                kwargs["otlp_endpoint"] = check_endpoint(endpoint)
            except ValueError as e:
                raise UsageError(f"--otlp-endpoint: {e}") from e
        kwargs.update(_failure_knobs(args))
        kwargs["budgets"] = budgets_from_args(args)
        kwargs["routing"] = routing_from_args(args)
        kwargs["disaggregate"] = disaggregate_from_args(args)
        kwargs.update(_canary_knobs(args))
        # Optional knobs a future CLI may add; absent means the defaults above.
        kv_host = getattr(args, "kv_host_bytes", None)
        if kv_host is not None and kv_host < 0:
            raise UsageError(f"`--kv-host-bytes {kv_host}` must be >= 0 (0: no host KV tier)")
        if kwargs["disaggregate"].enabled and (kv_host == 0 or not engine["prefix_cache"]):
            off = "--kv-host-bytes 0" if kv_host == 0 else "--no-prefix-cache"
            raise UsageError(f"`{off}` turns off the host KV tier that disaggregated prefill moves KV through. "
                             "Accepted: one of them (--disaggregate off, or the tier on)")
        threads = getattr(args, "threads", None)
        if threads is not None and threads < 1:
            raise UsageError(f"`--threads {threads}` must be >= 1 (the CPU threads of all workers together)")
        for name in ("max_body_bytes", "drain_timeout_s", "kv_cache_bytes", "kv_host_bytes", "threads"):
            value = getattr(args, name, None)
            if value is not None:
                kwargs[name] = value
        for name in ("header_timeout", "body_timeout"):
            if getattr(args, name, None) is not None:
                kwargs[f"{name}_s"] = getattr(args, name)
        return cls(**kwargs)


# `hetserve serve` flag -> (settings field, smallest accepted value, whether the bound is strict)
_FAILURE_FLAGS = {
    "migration_limit": ("migration_limit", 0, False),
    "stall_timeout": ("stall_timeout_s", 0, True),
    "health_timeout": ("health_timeout_s", 0, True),
    "breaker_failures": ("breaker_failures", 1, False),
    "breaker_cooldown": ("breaker_cooldown_s", 0, False),
}


def _failure_knobs(args) -> dict:
    """The failure-handling flags that were given, checked (`UsageError` names the bad one)."""
    out = {}
    for flag, (name, low, strict) in _FAILURE_FLAGS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if value < low or (strict and value == low):
            bound = f"> {low}" if strict else f">= {low}"
            raise UsageError(f"`--{flag.replace('_', '-')} {value}` must be {bound}")
        out[name] = value
    return out


def _canary_knobs(args) -> dict:
    """The canary flags that were given, checked (`UsageError` names the bad one)."""
    out = {}
    interval = getattr(args, "canary_interval", None)
    if interval is not None:
        if not interval >= 0:
            raise UsageError(f"`--canary-interval {interval}` must be >= 0 seconds (0 turns the canary off)")
        out["canary_interval_s"] = float(interval)
    agreement = getattr(args, "canary_min_agreement", None)
    if agreement is not None:
        if not 0.0 <= agreement <= 1.0:
            raise UsageError(f"`--canary-min-agreement {agreement}` must be a fraction in [0, 1]")
        out["canary_min_agreement"] = float(agreement)
    action = getattr(args, "canary_action", None)
    if action is not None:
        if action not in CANARY_ACTIONS:
            raise UsageError(f"`--canary-action {action}` is not an action. Accepted: {', '.join(CANARY_ACTIONS)}")
        out["canary_action"] = action
    return out
