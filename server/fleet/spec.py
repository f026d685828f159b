"""How each worker process is started: its id, configuration, command and environment (pure).

One worker per selected device. Its configuration is one `WorkerConfig` (workers/contract/
config.py), written as JSON beside its socket before each start; the command is then
`python -m workers --config FILE`. What the worker would otherwise read from this process's
environment is resolved here, once (`$HETSERVE_COMPILE`, `$HETSERVE_PREFLIGHT`, a simulated
device's `$HETSERVE_SLOWDOWN`). Design: the environment is fixed before the child's Python
starts, which is what makes "bind first" possible: a real GPU worker sees exactly one device
(`CUDA_VISIBLE_DEVICES=<its UUID>`), a simulated one none, and each compiles into its
architecture's own Triton cache. Trade-off: workers that compute on the CPU share this host's
cores (`threads_per_worker`), less one for the router where a small model's step is as short as a
streamed token's relay (`thread_choice`), so none oversubscribes them and each gets fewer
threads than the host has.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from server.config.api_key import ENV_API_KEY
from server.config.budgets import worker_budget
from server.config.compile import AUTO as AUTO_COMPILE
from server.config.settings import RouterSettings
from server.errors import UsageError
from server.fleet.kv_tier_dir import tier_dir_for
from workers.contract import (
    ENV_COMPILE,
    ENV_DEVICE_INDEX,
    ENV_DEVICE_UUID,
    ENV_PREFLIGHT,
    ENV_SIMULATE,
    DeviceInfo,
    WorkerConfig,
    cpu_device,
    step_token_budget,
    use_triton_cache,
)
from workers.contract.model_size import ModelSizeError, read_profile
from workers.contract.slowdown import ENV_SLOWDOWN, device_slowdown

_REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: server/fleet/spec.py -> ../..

# Variables that choose a device: never inherited from the router's own environment.
_DEVICE_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    ENV_SIMULATE,
    ENV_DEVICE_INDEX,
    ENV_DEVICE_UUID,
)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything needed to (re)start one worker; the supervisor keeps it for restarts."""

    id: str
    device: DeviceInfo
    socket_path: Path
    status_path: Path
    config: WorkerConfig  # written to `config_path` before each start
    command: tuple[str, ...]  # the worker program (`python -m workers`, or a stand-in's)
    env: tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable and comparable
    threads: int
    model: str = ""  # the name of the model it serves (server/config/models.py)
    model_dir: Path | None = None

    @property
    def config_path(self) -> Path:
        return self.status_path.with_name(f"{self.id}.config.json")

    @property
    def argv(self) -> tuple[str, ...]:
        return (*self.command, "--config", str(self.config_path))

    def write_config(self) -> Path:
        """The configuration file the command reads (rewritten before each start)."""
        return self.config.write(self.config_path)

    def environ(self) -> dict[str, str]:
        return dict(self.env)


def worker_id(device: DeviceInfo) -> str:
    """`gpu0`, `gpu2` (physical index) or `cpu0`."""
    return f"{'cpu' if device.type == 'cpu' else 'gpu'}{device.index}"


def available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# Under this many weights a CPU model step lasts about as long as a streamed token's relay in the
# router, which preempts one of the step's threads when they fill every core; from here on the
# step gains more from the last core than the relay costs it (docs/benchmarks.md, "One core for the
# router and the HTTP side" and "Against llama.cpp").
SMALL_MODEL_PARAMS = 32_000_000


def model_parameters(model_dirs) -> int | None:
    """The most weights of the models in `model_dirs` (their files' count, no weight read); None
    where none can be read."""
    counts = []
    for d in model_dirs:
        try:
            counts.append(read_profile(d).num_parameters)
        except (ModelSizeError, OSError, ValueError):
            continue
    return max(counts) if counts else None


def thread_choice(settings: RouterSettings, devices: list[DeviceInfo], params: int | None = None) -> tuple[int, str]:
    """(CPU threads for all workers together, why): the settings' `threads` when given; else this
    process's CPUs, less one for the router and the workers' HTTP side when the workers compute
    on the CPU (simulated or CPU devices), there are cores to spare and the model is small (under
    `SMALL_MODEL_PARAMS` weights, or `params` unknown), as vLLM keeps one for its API server: a
    small model's step whose OpenMP threads fill every core is preempted by each streamed token's
    relay. A larger model's step is many relays long, and every core computes it."""
    if settings.threads:
        return settings.threads, f"--threads {settings.threads}"
    cpus = available_cpus()
    if not all(d.computes_on_cpu for d in devices):
        return cpus, f"every CPU ({cpus}): the workers compute on GPUs"
    if cpus == 1:
        return 1, "the only CPU"
    if params is not None and params >= SMALL_MODEL_PARAMS:
        return cpus, (f"every CPU ({cpus}): a step of {params / 1e6:.0f}M weights lasts many streamed tokens' "
                      f"relays, and gains more from the last core than the relays cost it")
    return cpus - 1, (f"{cpus - 1} of {cpus} CPUs, one kept for the router: a step of "
                      f"{'an unknown model' if params is None else f'{params / 1e6:.0f}M weights'} is as short as a "
                      f"streamed token's relay, which would preempt one of its threads")


def threads_per_worker(total_threads: int, n_workers: int) -> int:
    """CPU threads each worker gets when `n_workers` share `total_threads` (at least one)."""
    return max(1, total_threads // max(1, n_workers))


def worker_threads(settings: RouterSettings, devices: list[DeviceInfo],
                   models: Mapping[int, tuple[str, Path]] | None = None) -> tuple[int, str]:  # fmt: skip
    """(CPU threads of each worker, why): `thread_choice` for the largest model the workers start
    with (`models`: device index -> (name, directory); default the settings' model), shared by
    every device's worker."""
    devices = list(devices) or [cpu_device()]
    dirs = {m for _, m in models.values()} if models else {settings.model_dir}
    total, why = thread_choice(settings, devices, model_parameters(dirs))
    return threads_per_worker(total, len(devices)), why


def worker_environment(device: DeviceInfo, threads: int, base: dict[str, str]) -> dict[str, str]:
    """The child's environment: `base` without inherited device choices, plus this device's."""
    env = {k: v for k, v in base.items() if k not in _DEVICE_ENV}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env[ENV_DEVICE_INDEX] = str(device.index)
    env[ENV_DEVICE_UUID] = device.uuid
    token = device.simulate_token
    if token is not None or device.type == "cpu":
        # Simulated, or the host CPU: the worker computes on the CPU and must not see any GPU.
        if token is not None:
            env[ENV_SIMULATE] = token
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif device.type == "rocm":
        # ROCr pins by the KFD unique id (server/commands/inventory_amd.py): no index to agree on
        # across vendors; HIP also reads CUDA_VISIBLE_DEVICES, which stays unset
        if device.uuid.lower().startswith("gpu-") and "kfd" not in device.uuid:
            env["ROCR_VISIBLE_DEVICES"] = device.uuid
        else:
            env["HIP_VISIBLE_DEVICES"] = str(device.index)
    else:
        env["CUDA_VISIBLE_DEVICES"] = device.uuid
    use_triton_cache(device.arch_name, env)  # <root>/<arch>: no two architectures share binaries
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    # `python -m workers` must import this checkout even when it is not installed.
    path = env.get("PYTHONPATH", "")
    if str(_REPO_ROOT) not in path.split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), path) if p)
    return env


def _slowdown_fields(spec: str, spec_id: str, device: DeviceInfo) -> dict:
    """`slowdown` and `prefill_slowdown` of a worker from `$HETSERVE_SLOWDOWN` (workers/contract/slowdown.py)."""
    found = device_slowdown(spec, spec_id, device.simulated, device.arch)
    return {"slowdown": found.decode, "prefill_slowdown": None if found.prefill == found.decode else found.prefill}


def worker_config(spec_id: str, device: DeviceInfo, settings: RouterSettings, socket_path: Path,
                  status_path: Path, threads: int, parent_pid: int, model_dir: Path | None = None,
                  environ: dict[str, str] | None = None, kv_host_dir: Path | None = None) -> WorkerConfig:
    """The configuration of the worker `spec_id` on `device` (`model_dir`: the model it serves,
    default the settings' default model); `environ`: this process's environment, whose
    `$HETSERVE_COMPILE`, `$HETSERVE_PREFLIGHT` and `$HETSERVE_SLOWDOWN` it carries (the module
    docstring); `kv_host_dir`: the run's host KV tier (server/fleet/kv_tier_dir.py). `UsageError`
    names a bad value."""
    environ = os.environ if environ is None else environ
    try:
        return WorkerConfig(
            socket=str(socket_path), worker_id=spec_id, model=str(model_dir or settings.model_dir),
            simulate=device.simulate_token, device_index=device.index, device_uuid=device.uuid,
            dtype=settings.dtype, quantize=settings.quantize, gguf_activations=settings.gguf_activations,
            max_batch=settings.max_batch,
            max_queue=settings.max_queue, kv_cache_bytes=settings.kv_cache_bytes,
            max_model_len=settings.max_model_len, gpu_memory_utilization=settings.gpu_memory_utilization,
            kv_block_size=settings.kv_block_size, no_prefix_cache=not settings.prefix_cache,
            kv_host_bytes=settings.kv_host_bytes,
            kv_host_dir=str(kv_host_dir) if kv_host_dir is not None and settings.kv_host_bytes != 0 else None,
            max_num_batched_tokens=settings.max_num_batched_tokens
            or step_token_budget(device.computes_on_cpu, settings.max_batch),
            deterministic=settings.deterministic,
            compile=settings.compile if settings.compile != AUTO_COMPILE else environ.get(ENV_COMPILE) or AUTO_COMPILE,
            speculative=settings.speculative.mode, num_speculative_tokens=settings.speculative.num_tokens,
            threads=threads, status_file=str(status_path), parent_pid=parent_pid,
            otlp_endpoint=settings.otlp_endpoint, preflight=environ.get(ENV_PREFLIGHT) or AUTO_COMPILE,
            **_slowdown_fields(environ.get(ENV_SLOWDOWN, ""), spec_id, device),
            **_lora_fields(settings, model_dir),
            **worker_budget(settings.budgets),
        )
    except ValueError as e:  # a `WorkerConfigError`, a bad `$HETSERVE_SLOWDOWN`
        raise UsageError(f"worker {spec_id}: {e}") from e


def build_worker_spec(device: DeviceInfo, model: str, model_dir: Path, settings: RouterSettings, run_dir: Path,
                      parent_pid: int, threads: int, base: dict[str, str]) -> WorkerSpec:
    """The spec of the worker that serves `model` (from `model_dir`) on `device`."""
    wid = worker_id(device)
    socket_path = run_dir / f"{wid}.sock"
    status_path = run_dir / f"{wid}.status.json"
    env = worker_environment(device, threads, base)
    # torch's compile cache, else an empty /tmp/torchinductor_<user> outlives every run
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(run_dir / f"{wid}.inductor"))
    env.pop(ENV_API_KEY, None)  # workers have no use for the router's key
    config = worker_config(wid, device, settings, socket_path, status_path, threads, parent_pid, model_dir, base,
                           tier_dir_for(run_dir))
    return WorkerSpec(wid, device, socket_path, status_path, config, tuple(settings.worker_command),
                      tuple(sorted(env.items())), threads, model, model_dir)


def build_worker_specs(devices: list[DeviceInfo], settings: RouterSettings, run_dir: Path,
                       parent_pid: int, base_env: dict[str, str] | None = None,
                       models: dict[int, tuple[str, Path]] | None = None) -> list[WorkerSpec]:
    """One spec per device; no device at all gives the single CPU worker. `models`: device index
    -> (model name, directory) for the devices that serve one (default: every device serves the
    settings' default model); the threads are shared as if every device had its worker."""
    devices = list(devices) or [cpu_device()]
    base = dict(os.environ if base_env is None else base_env)
    if models is None:
        models = {d.index: (settings.model_name, settings.model_dir) for d in devices}
    threads, _ = worker_threads(settings, devices, models)
    return [build_worker_spec(d, *models[d.index], settings, run_dir, parent_pid, threads, base)
            for d in devices if d.index in models]


def _lora_fields(settings: RouterSettings, model_dir: Path | None,
                 runtime: Mapping[str, Path] | None = None) -> dict:  # fmt: skip
    """The LoRA adapters of a worker of the default model (server/config/loras.py), `--lora`'s then those
    loaded at run time (`runtime`), and its limits (which adapters loaded at run time meet too); none
    for another model's."""
    loras = settings.loras
    if model_dir is not None and Path(model_dir) != Path(settings.model_dir):
        return {}
    adapters = {**dict(loras.adapters), **(runtime or {})}
    lora = ",".join(f"{name}={path}" for name, path in adapters.items()) or None
    return {"lora": lora, "max_loras": loras.max_loras, "max_lora_rank": loras.max_lora_rank,
            "max_cpu_loras": loras.max_cpu_loras}


def with_runtime_loras(spec: WorkerSpec, settings: RouterSettings, runtime: Mapping[str, Path]) -> WorkerSpec:
    """`spec` whose worker, when it (re)starts, reads the adapters loaded at run time besides `--lora`'s
    (the supervisor calls it before each start); another model's worker is left as is."""
    fields = _lora_fields(settings, spec.model_dir, runtime)
    if not fields or spec.config.lora == fields["lora"]:
        return spec
    return replace(spec, config=replace(spec.config, **fields))
