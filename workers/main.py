"""The worker process: one device, one model, one engine, one Unix socket.

`run_worker(args)` reads top-down as the mission: bind -> capability -> load -> kernelize ->
fp8 -> serve (the KV cache, engine and app, then `compile`: the decode step per batch bucket,
workers/engine/compiled.py, before the socket listens). Right after binding, Triton is
pointed at this architecture's own cache directory (before anything imports it). On a real
GPU, kernelize also compiles every selected kernel for the device ahead of time and checks
it against the device's limits (the preflight), and once fp8 has swapped in its layers one
forward is compared with the torch reference path (the self-test); either failing fails the
start at `kernelize`. Everything is built inside this process (vLLM `run_engine_core` style):
the router passes only arguments and environment. Each startup step is logged once with its
duration and written to the status file, so a worker that cannot start says which step
failed and why (exit 3), distinct from a fatal error while serving (exit 4). A start failure
is one console line (step and reason), its traceback only in the debug log
(HETSERVE_LOG_LEVEL=debug) and the status file's `traceback`: the router repeats the reason
once per worker, and a bad checkpoint no longer floods the console with chained tracebacks. A clean
shutdown (SIGTERM, or the parent dying) drains in-flight requests within a bound and
exits 0. Cleanup happens in `finally`, whatever the path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator

from workers.contract import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MODEL_DIR,
    ENV_COMPILE,
    ENV_DEVICE_INDEX,
    ENV_PREFLIGHT,
    PREFLIGHT_MODES,
    ExitCode,
    WorkerStatus,
    engine_limits_error,
    step_token_budget,
    use_triton_cache,
)
from workers.device.host_memory import keep_freed_memory
from workers.model.row_buckets import cap_native_caches
from workers.sampling.grammar_sandbox import CompileBudget, add_budget_args

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers", description="hetserve worker: serve one device.")
    p.add_argument("--socket", required=True, help="Unix socket path to listen on (created with mode 0600)")
    p.add_argument("--worker-id", help="name in logs, headers and /capability (default: worker-<device index>)")
    p.add_argument("--model", help="HF-layout model directory (default: the embedded model)")
    p.add_argument("--simulate", help="simulated device token, e.g. sm_89, gfx942, cpu")
    p.add_argument("--device-index", type=int, help="physical device index (default: $HETSERVE_DEVICE_INDEX or 0)")
    p.add_argument("--device-uuid", help="device UUID to check after binding")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--quantize", default="none", choices=("none", "fp8"))
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="most sequences running at once")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests waiting beyond the batch before 429")
    p.add_argument("--kv-cache-bytes", type=int,
                   help="KV cache budget (default: 85%% of free GPU memory; on CPU --max-batch full-context "
                        "sequences, at most 512 MiB)")
    p.add_argument("--max-model-len", type=int,
                   help="longest sequence served: the context is capped at it (default: the checkpoint's)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="fraction of the device's own memory for weights and KV cache (0 < F <= 1; on a simulated "
                        "device, of its simulated memory); see workers/kv/sizing.py")
    p.add_argument("--kv-block-size", type=int, default=DEFAULT_KV_BLOCK_SIZE,
                   help=f"tokens per KV cache block (default {DEFAULT_KV_BLOCK_SIZE})")
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse the KV blocks of shared prompt prefixes")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens one engine step computes: decodes first, then prompt chunks (default "
                        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS} on a GPU, {CPU_MAX_NUM_BATCHED_TOKENS} where the step computes "
                        "on the CPU: a CPU or simulated device)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: a request's output does not depend on its batch mates "
                        "(fixed GEMM row tiles and attention splits; see workers/model/deterministic.py)")
    p.add_argument("--compile", default=os.environ.get(ENV_COMPILE, "auto"),
                   help="the decode step compiled per batch bucket (Inductor on CPU, CUDA/HIP graphs on GPUs): auto "
                        "(real GPUs and CPU workers, not simulated GPUs), on, off (default: "
                        f"${ENV_COMPILE} or auto); see workers/engine/compiled.py")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--status-file", help="JSON status file, rewritten atomically at each step")
    p.add_argument("--parent-pid", type=int, help="exit when this process dies")
    p.add_argument("--otlp-endpoint", metavar="URL", help="export OpenTelemetry spans (OTLP) to this collector")
    add_budget_args(p)
    p.add_argument("--pipeline-plan", metavar="FILE",
                   help="serve as a stage of this pipeline plan (written by the router; workers/pipeline/)")
    p.add_argument("--pipeline-rank", type=int, default=0,
                   help="this worker's stage in --pipeline-plan (0: the first, which starts the others)")
    p.add_argument("--pipeline-batches", type=int,
                   help="batches in flight through a pipeline at once, each of its own sequences (default: one per "
                        "stage; 1: one step at a time; see workers/pipeline/engine.py)")
    p.add_argument("--pipeline-microbatches", type=int,
                   help="micro-batches each step of a pipeline is cut into (default 1)")
    p.add_argument("--preflight", choices=PREFLIGHT_MODES, default=os.environ.get(ENV_PREFLIGHT, "auto"),
                   help="compile and check the selected kernels before ready: auto (real GPUs), on (simulated "
                        f"GPUs too), off (default: ${ENV_PREFLIGHT} or auto)")  # fmt: skip
    args = p.parse_args(argv)
    for name in ("max_batch", "threads", "kv_cache_bytes", "max_model_len", "pipeline_microbatches",
                 "pipeline_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"`--{name.replace('_', '-')}` must be >= 1, got `{value}`")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        p.error(f"`--gpu-memory-utilization {args.gpu_memory_utilization}` is no fraction. Accepted: 0 < F <= 1")
    if args.max_queue < 0:
        p.error(f"`--max-queue` must be >= 0, got `{args.max_queue}`")
    if args.preflight not in PREFLIGHT_MODES:  # a default from the environment skips argparse's check
        p.error(f"`${ENV_PREFLIGHT}={args.preflight}` is not a preflight mode. Accepted: {', '.join(PREFLIGHT_MODES)}")
    error = engine_limits_error(args.kv_block_size, args.max_num_batched_tokens, args.max_batch)
    if error:
        p.error(error)
    if args.compile not in ("auto", "on", "off"):
        p.error(f"`--compile {args.compile}` is not a mode (or `${ENV_COMPILE}`). Accepted: auto, on, off")
    try:
        CompileBudget.from_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


class StartupError(RuntimeError):
    """A startup step that cannot complete; `step` names it."""

    def __init__(self, step: str, reason: str):
        super().__init__(f"{step}: {reason}")
        self.step, self.reason = step, reason


class _ShutdownRequested(BaseException):
    """SIGTERM (or the parent's death) before serving started."""


class StatusFile:
    """The JSON status the router reads; rewritten atomically (write + rename)."""

    def __init__(self, path: str | None, worker_id: str):
        self.path, self.worker_id = path, worker_id

    def write(self, state: WorkerStatus, **fields) -> None:
        if not self.path:
            return
        body = {"state": state, **fields, "worker_id": self.worker_id, "pid": os.getpid(), "time": time.time()}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(body, f)
            os.replace(tmp, self.path)
        finally:  # interrupted (a signal mid-write): leave no half-written file behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


@contextlib.contextmanager
def startup_step(name: str, status: StatusFile) -> Iterator[None]:
    """Run one mission step: status `starting`, one log line with its duration, and any
    exception turned into `StartupError(name, reason)`."""
    status.write(WorkerStatus.STARTING, step=name)
    t0 = time.perf_counter()
    try:
        yield
    except (StartupError, _ShutdownRequested):
        raise
    except Exception as e:
        raise StartupError(name, f"{type(e).__name__}: {e}") from e
    logger.info("step %s done in %.3fs", name, time.perf_counter() - t0)


def startup_traceback(e: StartupError) -> str:
    """The traceback of the exception that failed the step (the status file keeps it for debugging)."""
    return "".join(traceback.format_exception(e.__cause__ or e))


def _default_worker_id(args: argparse.Namespace) -> str:
    index = args.device_index if args.device_index is not None else os.environ.get(ENV_DEVICE_INDEX, "0")
    return f"worker-{index}"


def configure_logging(worker_id: str) -> None:
    logging.basicConfig(
        level=os.environ.get("HETSERVE_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s [{worker_id}] %(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> int:
    cap_native_caches()  # before torch loads (see workers/model/row_buckets.py)
    memory = keep_freed_memory()  # before the first step's temporaries (workers/device/host_memory.py)
    args = parse_args(argv)
    args.worker_id = args.worker_id or _default_worker_id(args)
    configure_logging(args.worker_id)
    logger.info("host memory: %s", memory)
    return run_worker(args)


def run_worker(args: argparse.Namespace) -> int:
    """bind -> capability -> load -> kernelize -> fp8 -> serve."""
    status = StatusFile(args.status_file, args.worker_id)
    phase: dict = {"server": None}  # the uvicorn server once serving
    _install_sigterm(phase)
    _watch_parent(args.parent_pid)
    server = stages = plan = link = None
    try:
        if args.pipeline_plan:  # one stage of a pipeline: the first starts the others now, so all load at once
            with startup_step("pipeline", status):
                from workers.contract.pipeline import PipelinePlan

                plan = PipelinePlan.read(args.pipeline_plan)
                if not 0 <= args.pipeline_rank < plan.world_size:
                    raise ValueError(f"`--pipeline-rank {args.pipeline_rank}` is not a stage of the plan's "
                                     f"{plan.world_size}")
                if args.pipeline_rank == 0:
                    from workers.pipeline.launch import Stages

                    stages = Stages(plan, args.pipeline_plan)
        layers = None if plan is None else (plan.stages[args.pipeline_rank].start, plan.stages[args.pipeline_rank].end)
        with startup_step("bind", status):
            from workers.device.bind import bind_device

            bound = bind_device(args.simulate, args.device_index, args.device_uuid)
            logger.info("Triton cache %s", use_triton_cache(bound.arch_name))  # before Triton is imported
            if args.max_num_batched_tokens is None:  # this device's step budget (workers/contract/defaults.py)
                args.max_num_batched_tokens = step_token_budget(bound.computes_on_cpu, args.max_batch)
        if args.threads:  # the CPU threads the router gave this worker, before any compute
            import torch

            torch.set_num_threads(args.threads)
        with startup_step("capability", status):
            from workers.device.bind import capability

            cap = capability()
            logger.info("capability %s (%s)", bound.capability_label, bound.type)
        with startup_step("load", status):
            from workers.model.loader import load_model

            loaded = load_model(args.model or DEFAULT_MODEL_DIR, args.dtype, bound.torch_device, cap, layers,
                                device_type=bound.type)
        with startup_step("kernelize", status):  # also checks `kernels`' own capability lookup
            from workers.kernelize.apply import kernelize_for_device
            from workers.kernelize.preflight import model_workload, preflight_or_refuse, wants_preflight

            kernels = kernelize_for_device(loaded.model, bound)
            compiled = None
            if wants_preflight(args.preflight, bound):  # every selected kernel compiled and fitting
                compiled = preflight_or_refuse(bound, model_workload(loaded.config, loaded.dtype))
        with startup_step("fp8", status):
            from workers.quant.fp8_convention import choose_fp8, lock_convention

            conv, fp8_reason = choose_fp8(bound.type, cap)
            lock_convention(conv)
            checkpoint = None
            if loaded.quantization is not None:  # pre-quantized: the stored bytes in this device's execution
                from workers.quant.prepare import prepare_fp8_checkpoint

                checkpoint = prepare_fp8_checkpoint(loaded.model, conv, bound.type, cap)
            if args.quantize == "fp8":
                from workers.quant.quantize_model import quantize_model

                logger.info("fp8 weights: %s", quantize_model(loaded.model, conv))
            logger.info("fp8 convention %s: %s", conv.name, fp8_reason)
        if bound.is_real_gpu:
            with startup_step("kernelize", status):  # its last check, once fp8 swapped in its layers
                from workers.kernelize.selftest import self_test

                logger.info("self-test: %s", self_test(loaded.model, loaded.config, bound.torch_device))
        if plan is not None:  # every stage joins the replica's process group
            with startup_step("pipeline", status):
                link = _join_pipeline(plan, args.pipeline_rank, bound, loaded, stages)
        if link is not None and not link.first:
            return _serve_stage(args, status, bound, loaded, kernels, conv, fp8_reason, link, checkpoint)
        with startup_step("serve", status):
            from workers.device.slowdown import apply_slowdown
            from workers.serving.server import Startup, WorkerServer

            apply_slowdown(loaded.model, args.worker_id)  # $HETSERVE_SLOWDOWN: benchmarks and tests only

            server = WorkerServer(Startup(args, bound, loaded, kernels, conv, fp8_reason, compiled, checkpoint,
                                          None if link is None else (link, stages)))
        with startup_step("compile", status):  # the decode step per batch bucket, before the first request
            logger.info("decode step: %s", server.compile())
        phase["server"] = server.server
        server.run(on_ready=lambda: status.write(WorkerStatus.READY, socket=args.socket))
        if server.fatal_error is not None:
            status.write(WorkerStatus.FATAL, reason=f"{type(server.fatal_error).__name__}: {server.fatal_error}")
            return ExitCode.FATAL
        status.write(WorkerStatus.STOPPED)
        return ExitCode.OK
    except StartupError as e:
        # one line on the console; the chained traceback only in the debug log and the status file
        logger.error("failed to start at step %s: %s", e.step, e.reason)
        logger.debug("failed to start at step %s", e.step, exc_info=True)
        status.write(WorkerStatus.FAILED, step=e.step, reason=e.reason, traceback=startup_traceback(e))
        return ExitCode.FAILED_TO_START
    except _ShutdownRequested:
        logger.info("shutdown requested before serving; exiting")
        status.write(WorkerStatus.STOPPED)
        return ExitCode.OK
    except Exception as e:
        logger.exception("fatal error while serving")
        status.write(WorkerStatus.FATAL, reason=f"{type(e).__name__}: {e}")
        return ExitCode.FATAL
    finally:
        if server is not None:
            server.close()
        elif stages is not None:  # the first stage failed before serving: its stages go with it
            stages.stop(timeout=0.0)


def _join_pipeline(plan, rank: int, bound, loaded, stages):
    """This stage's link in the replica's process group (the first stage fails as soon as a stage exits)."""
    import torch

    from workers.pipeline.transport import StageLink

    def join():
        return StageLink.join(plan, rank, torch.device(bound.torch_device), loaded.dtype)

    return join() if stages is None else stages.wait_for(join)


def _serve_stage(args, status: StatusFile, bound, loaded, kernels, conv, fp8_reason, link, checkpoint) -> int:
    """A stage after the first: its loop until the pipeline stops (workers/pipeline/follower.py)."""
    from workers.device.slowdown import apply_slowdown
    from workers.pipeline.follower import serve_stage
    from workers.pipeline.metrics import StageClock

    apply_slowdown(loaded.model, args.worker_id)  # $HETSERVE_SLOWDOWN: benchmarks and tests only
    status.write(WorkerStatus.READY, stage=link.rank)
    context = min(loaded.config.context_length, args.max_model_len or loaded.config.context_length)
    stored = checkpoint is not None and (checkpoint.get("layers", 0) + checkpoint.get("expert_layers", 0)) > 0
    used = args.quantize == "fp8" or stored  # fp8 as it runs on this stage, as the first stage labels its own
    label = conv.name if used else f"not used ({str(loaded.dtype).removeprefix('torch.')})"
    fp8 = {"convention": conv.name, "reason": fp8_reason, "used": used, "label": label}
    def report(clock: StageClock) -> None:  # read by the first stage's /metrics and its timing records
        status.write(WorkerStatus.READY, stage=link.rank, **clock.figures())

    clock = StageClock(report, host_cpu=bound.simulated or bound.type == "cpu")
    serve_stage(args, bound, loaded, kernels, fp8, link, context, clock)
    status.write(WorkerStatus.STOPPED, stage=link.rank, **clock.figures())  # its last figures, for the records
    return ExitCode.OK


def _install_sigterm(phase: dict) -> None:
    """Before serving, SIGTERM ends startup at once; while serving, uvicorn owns SIGTERM (graceful
    drain) and afterwards re-raises it into this handler, which then has nothing left to do."""

    def on_sigterm(signum, frame):
        server = phase.get("server")
        if server is not None:
            server.should_exit = True  # between the serve step and uvicorn taking over SIGTERM
        elif not phase.get("stopping"):
            # Once only: the parent's death may signal twice (PR_SET_PDEATHSIG and the parent
            # watch); a second raise would interrupt the shutdown that the first one started.
            phase["stopping"] = True
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already, through exit
            raise _ShutdownRequested()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def _watch_parent(parent_pid: int | None) -> None:
    """A daemon thread that sends this process SIGTERM once `parent_pid` is gone."""
    if not parent_pid:
        return
    was_parent = os.getppid() == parent_pid

    def alive() -> bool:
        if was_parent and os.getppid() != parent_pid:  # re-parented: our parent exited
            return False
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def watch():
        while alive():
            time.sleep(PARENT_POLL_S)
        logger.warning("parent process %s is gone; shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
