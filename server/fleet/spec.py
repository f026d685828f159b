"""How each worker process is started: its id, command line and environment (pure).

One worker per selected device. The environment is fixed before the child's Python starts,
which is what makes "bind first" possible: a real GPU worker sees exactly one device
(`CUDA_DEVICE_ORDER=PCI_BUS_ID`, `CUDA_VISIBLE_DEVICES=<its UUID>`), a simulated one sees
none (`CUDA_VISIBLE_DEVICES=""`) and learns its capability from `HETSERVE_SIMULATE`.
Simulated workers share this host's CPUs: each gets `--threads` = CPUs / workers, so three
simulated devices on two cores do not oversubscribe them threefold. Workers that compute on
the CPU leave one core to the router and the HTTP side (`compute_threads`), as vLLM keeps one
for its API server: a model step whose OpenMP threads fill every core is preempted by each
streamed token's relay. Each worker compiles into
its architecture's own Triton cache (`TRITON_CACHE_DIR=<root>/sm_89`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from server.config.api_key import ENV_API_KEY
from server.config.budgets import worker_args as budget_worker_args
from server.config.settings import RouterSettings
from workers.contract import (
    ENV_DEVICE_INDEX,
    ENV_DEVICE_UUID,
    ENV_SIMULATE,
    DeviceInfo,
    cpu_device,
    step_token_budget,
    use_triton_cache,
)

_REPO_ROOT = Path(__file__).resolve().parent.parent

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
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # sorted (name, value) pairs: hashable and comparable
    threads: int
    model: str = ""  # the name of the model it serves (server/config/models.py)
    model_dir: Path | None = None

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


def compute_threads(settings: RouterSettings, devices: list[DeviceInfo]) -> int:
    """CPU threads for all workers together: the settings' `threads` when given; else this
    process's CPUs, less one for the router and the workers' HTTP side when the workers compute
    on the CPU (simulated or CPU devices) and there are cores to spare. On the 2-core machine one
    CPU worker with both cores took 2.2 ms per output token at concurrency 1 and 8.4 ms at 32
    (streamed completions, 128-token prompts); with one, 1.4 ms and 7.6 ms."""
    if settings.threads:
        return settings.threads
    cpus = available_cpus()
    on_cpu = all(d.computes_on_cpu for d in devices)
    return cpus - 1 if on_cpu and cpus > 1 else cpus


def threads_per_worker(total_threads: int, n_workers: int) -> int:
    """CPU threads each worker gets when `n_workers` share `total_threads` (at least one)."""
    return max(1, total_threads // max(1, n_workers))


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


def worker_argv(spec_id: str, device: DeviceInfo, settings: RouterSettings, socket_path: Path,
                status_path: Path, threads: int, parent_pid: int, model_dir: Path | None = None) -> tuple[str, ...]:
    """The command line of `python -m workers` (its arguments are the worker's `parse_args`);
    `model_dir`: the model it serves (default: the settings' default model)."""
    argv = [
        *settings.worker_command,
        "--socket", str(socket_path),
        "--worker-id", spec_id,
        "--model", str(model_dir or settings.model_dir),
        "--device-index", str(device.index),
        "--device-uuid", device.uuid,
        "--dtype", settings.dtype,
        "--quantize", settings.quantize,
        "--max-batch", str(settings.max_batch),
        "--max-queue", str(settings.max_queue),
        "--kv-block-size", str(settings.kv_block_size),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens
                                        or step_token_budget(device.computes_on_cpu, settings.max_batch)),
        "--threads", str(threads),
        "--status-file", str(status_path),
        "--parent-pid", str(parent_pid),
    ]
    if device.simulate_token is not None:
        argv += ["--simulate", device.simulate_token]
    if not settings.prefix_cache:
        argv.append("--no-prefix-cache")
    if settings.kv_cache_bytes is not None:
        argv += ["--kv-cache-bytes", str(settings.kv_cache_bytes)]
    if settings.max_model_len is not None:
        argv += ["--max-model-len", str(settings.max_model_len)]
    if settings.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", f"{settings.gpu_memory_utilization:g}"]
    if settings.otlp_endpoint is not None:
        argv += ["--otlp-endpoint", settings.otlp_endpoint]
    if settings.deterministic:
        argv.append("--deterministic")
    argv += budget_worker_args(settings.budgets)  # the grammar compile budget, where not the default
    if settings.compile != "auto":  # the worker's default is auto (server/config/compile.py)
        argv += ["--compile", settings.compile]
    return tuple(argv)


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
    argv = worker_argv(wid, device, settings, socket_path, status_path, threads, parent_pid, model_dir)
    return WorkerSpec(wid, device, socket_path, status_path, argv, tuple(sorted(env.items())), threads, model,
                      model_dir)


def build_worker_specs(devices: list[DeviceInfo], settings: RouterSettings, run_dir: Path,
                       parent_pid: int, base_env: dict[str, str] | None = None,
                       models: dict[int, tuple[str, Path]] | None = None) -> list[WorkerSpec]:
    """One spec per device; no device at all gives the single CPU worker. `models`: device index
    -> (model name, directory) for the devices that serve one (default: every device serves the
    settings' default model); the threads are shared as if every device had its worker."""
    devices = list(devices) or [cpu_device()]
    base = dict(os.environ if base_env is None else base_env)
    threads = threads_per_worker(compute_threads(settings, devices), len(devices))
    if models is None:
        models = {d.index: (settings.model_name, settings.model_dir) for d in devices}
    return [build_worker_spec(d, *models[d.index], settings, run_dir, parent_pid, threads, base)
            for d in devices if d.index in models]
