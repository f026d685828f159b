"""The worker process: one device, one model, one engine, one Unix socket.

Design: `run_worker(config)` reads top-down as the mission, bind -> capability -> load ->
kernelize -> fp8 -> serve, and every step that changes the model or builds the engine runs from
here in that order: a CPU model's own paths after fp8, then the KV cache, the engine, the
`/capability` description and its server, then `compile` before the socket listens (the steps:
docs/worker.md, "The worker process"). Everything is built inside this process from one
`WorkerConfig` the router passes (vLLM `run_engine_core` style). Each startup step is logged once
with its duration and written to the status file, so a worker that cannot start says which step
failed and why (exit 3, one console line; its traceback in the debug log and the status file),
distinct from a fatal error while serving (exit 4); SIGTERM or the parent's death drains in-flight
requests and exits 0, and cleanup runs in `finally`. Trade-off: each step imports what it uses as
it runs, on purpose, so torch's native caches are capped and the Triton cache chosen before torch
and Triton load, at the price of imports spread through the function."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import replace

from workers.contract import (
    DEFAULT_MODEL_DIR,
    ENV_DEVICE_INDEX,
    ExitCode,
    KernelDescription,
    WorkerConfig,
    WorkerStatus,
    step_token_budget,
    use_triton_cache,
)
from workers.contract.gguf_rule import GGUF_EXACT
from workers.device.host_memory import keep_freed_memory
from workers.model.row_buckets import cap_native_caches
from workers.signals import ShutdownRequested, install_sigterm, watch_parent

logger = logging.getLogger(__name__)

def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    """The worker's configuration from its command line: `--config FILE` (what the router writes)
    and/or one flag per field (workers/contract/config.py); a bad one exits 2 naming it."""
    return WorkerConfig.from_argv(argv)


class StartupError(RuntimeError):
    """A startup step that cannot complete; `step` names it."""

    def __init__(self, step: str, reason: str):
        super().__init__(f"{step}: {reason}")
        self.step, self.reason = step, reason


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
    except (StartupError, ShutdownRequested):
        raise
    except Exception as e:
        raise StartupError(name, f"{type(e).__name__}: {e}") from e
    logger.info("step %s done in %.3fs", name, time.perf_counter() - t0)


def startup_traceback(e: StartupError) -> str:
    """The traceback of the exception that failed the step (the status file keeps it for debugging)."""
    return "".join(traceback.format_exception(e.__cause__ or e))


def _default_worker_id(config: WorkerConfig) -> str:
    index = config.device_index if config.device_index is not None else os.environ.get(ENV_DEVICE_INDEX, "0")
    return f"worker-{index}"


def configure_logging(worker_id: str) -> None:
    logging.basicConfig(
        level=os.environ.get("HETSERVE_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s [{worker_id}] %(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> int:
    cap_native_caches()  # before torch loads (see workers/model/row_buckets.py)
    memory = keep_freed_memory()  # before the first step's temporaries (workers/device/host_memory.py)
    config = parse_args(argv)
    config = replace(config, worker_id=config.worker_id or _default_worker_id(config))
    configure_logging(config.worker_id)
    logger.info("host memory: %s", memory)
    return run_worker(config)


def run_worker(config: WorkerConfig) -> int:
    """bind -> capability -> load -> kernelize -> fp8 -> serve."""
    status = StatusFile(config.status_file, config.worker_id)
    phase: dict = {"server": None}  # the uvicorn server once serving
    install_sigterm(phase)
    watch_parent(config.parent_pid)
    server = stages = plan = link = first = None
    try:
        if config.pipeline_plan:  # one stage of a pipeline: the first starts the others now, so all load at once
            with startup_step("pipeline", status):
                plan, stages = _read_plan(config)
        with startup_step("bind", status):
            from workers.device.bind import bind_device

            bound = bind_device(config.simulate, config.device_index, config.device_uuid)
            logger.info("Triton cache %s", use_triton_cache(bound.arch_name))  # before Triton is imported
            config = _for_device(config, bound)
        if config.threads:  # the CPU threads the router gave this worker, before any compute
            import torch

            torch.set_num_threads(config.threads)
        with startup_step("capability", status):
            from workers.device.bind import capability

            cap = capability()
            logger.info("capability %s (%s)", bound.capability_label, bound.type)
        with startup_step("load", status):
            from workers.device.slowdown import apply_slowdown
            from workers.model.loader import load_model

            layers = None if plan is None else (plan.stages[config.pipeline_rank].start,
                                                plan.stages[config.pipeline_rank].end)
            loaded = load_model(config.model or DEFAULT_MODEL_DIR, config.dtype, bound.torch_device, cap, layers,
                                device_type=bound.type)
            apply_slowdown(loaded.model, config.slowdowns)  # a simulated device only (`_for_device`)
            if config.gguf_activations != GGUF_EXACT:  # a GGUF file's CPU GEMV rounds a decode's rows
                from workers.gguf.linear import set_activations

                set_activations(loaded.model, config.gguf_activations)
        with startup_step("kernelize", status):  # also checks `kernels`' own capability lookup
            from workers.kernelize.apply import kernelize_for_device
            from workers.kernelize.preflight import model_workload, preflight_or_refuse, wants_preflight

            kernels = kernelize_for_device(loaded.model, bound)
            preflight = None
            if wants_preflight(config.preflight, bound):  # every selected kernel compiled and fitting
                preflight = preflight_or_refuse(bound, model_workload(loaded.config, loaded.dtype),
                                                _never_run(loaded, bound, config.quantize))
        with startup_step("fp8", status):
            conv, fp8_reason, checkpoint = apply_fp8(config, bound, cap, loaded)
        failed: dict[str, str] = {}  # layers whose kernel failed on this device: their torch path serves
        if bound.is_real_gpu:
            with startup_step("kernelize", status):  # its last check, once fp8 swapped in its layers
                from workers.kernelize.selftest import self_test_or_fall_back

                result, failed = self_test_or_fall_back(loaded.model, loaded.config, bound.torch_device)
                kernels = _torch_paths(kernels, failed)
                logger.info("self-test: %s", result)
        with startup_step("kernelize", status):  # a CPU model's own paths, over the layers fp8 left
            from workers.engine.build import install_cpu_paths

            # deterministic numerics are the first stage's (a later stage runs its layers as before)
            # a CPU worker under `--compile auto` serves first: C++ kernels not built on this host yet
            # build behind the serving (a simulated device is a GPU's stand-in: it builds them first)
            cpu = install_cpu_paths(loaded, bound, config.deterministic and config.pipeline_rank == 0,
                                    behind=config.compile == "auto" and plan is None and not bound.simulated)
        if plan is not None:  # every stage joins the replica's process group
            with startup_step("pipeline", status):
                link = _join_pipeline(plan, config, bound, loaded, stages)
        with startup_step("kv_cache", status):  # sized on this device; a pipeline's stages agree on the blocks
            from workers.engine.build import build_kv, context_length, decide_compile

            context = context_length(config, loaded)
            decision = decide_compile(config, bound, cpu, loaded.model, pipeline=link is not None)
            kv = build_kv(config, bound, loaded, context, decision.enabled, None if link is None else link.agree_blocks)
        from workers.engine.describe import (
            compile_description,
            describe_worker,
            fp8_description,
            kernel_description,
        )

        fp8 = fp8_description(conv, fp8_reason, config.quantize, checkpoint, loaded, preflight)
        if link is not None and not link.first:
            return _serve_stage(status, bound, loaded, kernels, fp8, cpu, link, kv)
        with startup_step("engine", status):  # runner, scheduler, grammars (a pipeline's: its first stage's)
            if link is None:
                from workers.engine.build import build_engine

                built = build_engine(config, bound, loaded, kv, decision, cpu, context)
                from workers.lora.worker import install_loras

                # LoRA adapters over the model (workers/lora/): `--lora` ones read and checked now
                install_loras(built.engine, config, loaded, bound.torch_device)
            else:
                from workers.pipeline.first import build_first_stage

                built, first = build_first_stage(config, bound, loaded, kv, decision, cpu, context, link, stages)
            built.fell_back(failed)  # `/workers` and `/metrics` say which kernels fell back, and why
        with startup_step("serve", status):  # the `/capability` description, the app, the socket
            from workers.serving.server import WorkerServer

            pipeline = None if first is None else first.describe(bound, loaded, kernels, fp8, kv)
            info = describe_worker(config, bound, loaded, kernels, fp8, preflight, cpu, built, context, pipeline)
            server = WorkerServer(config.socket, built.engine, loaded.tokenizer, info, config.otlp_endpoint)
            if first is not None:  # from here on, a stage that exits stops this replica
                first.stages.watch(server.stop)
        with startup_step("compile", status):  # the decode step per batch bucket (`auto` on a CPU: behind)
            def described() -> None:
                info.compile = compile_description(built.decision, built.compiled)
                info.preparing, info.fallbacks = built.preparing() or None, dict(built.fallbacks) or None
                if built.reinstall is not None:  # C++ kernels built behind the serving, then swapped in
                    info.kernels = {name: KernelDescription.model_validate(entry)
                                    for name, entry in kernel_description(kernels, built.cpu, preflight).items()}

            logger.info("decode step: %s", built.compile(on_change=described))
            described()
        phase["server"] = server.server
        server.run(on_ready=lambda: status.write(WorkerStatus.READY, socket=config.socket))
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
    except ShutdownRequested:
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
            if first is not None:  # the other stages stop after this one's last step
                first.close()
        elif stages is not None:  # the first stage failed before serving: its stages go with it
            stages.stop(timeout=0.0)


def _torch_paths(kernels: dict, failed: dict[str, str]) -> dict:
    """The kernel choices with each layer that failed its self-test on this device on its torch
    path, the reason saying why (`/workers` shows it)."""
    from dataclasses import replace

    return {layer: replace(choice, variant="torch", reason=f"torch path: the chosen kernel ({choice.variant}) "
                                                           f"failed on this device: {failed[layer]}")
            if layer in failed else choice for layer, choice in kernels.items()}


def _read_plan(config: WorkerConfig):
    """(the pipeline plan, the other stages' processes when this is the first stage, else None)."""
    from workers.contract.pipeline import PipelinePlan

    plan = PipelinePlan.read(config.pipeline_plan)
    if not config.pipeline_rank < plan.world_size:
        raise ValueError(f"`--pipeline-rank {config.pipeline_rank}` is not a stage of the plan's {plan.world_size}")
    if config.pipeline_rank != 0:
        return plan, None
    from workers.pipeline.launch import Stages

    return plan, Stages(plan, config.pipeline_plan)


def _never_run(loaded, bound, quantize: str) -> dict[str, str]:
    """The kernel layers this model never runs on this device, each with why: its preflight does not
    compile them (the plan's rule, workers/contract/kernel_layers.py, from what the worker loaded).
    `LoraDelta` is kept: adapters may be loaded while it serves; GGUF blocks (and experts) are asked of the model."""
    from workers.contract.kernel_layers import unused_layers
    from workers.gguf.execution import gguf_layer_unused
    from workers.model.describe import describe

    described = {**describe(loaded.config), "quantization": loaded.quantization}
    unused = unused_layers(described, bound.type, bound.capability, quantize)
    unused.pop("LoraDelta", None)
    unused.pop("GGUFLinear", None)
    unused.pop("GGUFExperts", None)
    return {**unused, **gguf_layer_unused(loaded.model)}


def _for_device(config: WorkerConfig, bound) -> WorkerConfig:
    """`config` with what the bound device decides: its step budget (workers/contract/defaults.py
    `step_token_budget`) where none was given; a slowdown only where the device is simulated."""
    if config.slowdowns.slowed and not bound.simulated:
        raise ValueError(f"`--slowdown {config.slowdowns.describe()}` slows a simulated device only; this worker is "
                         f"bound to {bound.type} device {bound.index}. Accepted: --slowdown 1 (or leave it out)")
    if config.max_num_batched_tokens is not None:
        return config
    return replace(config, max_num_batched_tokens=step_token_budget(bound.computes_on_cpu, config.max_batch))


def apply_fp8(config: WorkerConfig, bound, cap, loaded):
    """(the device's fp8 convention, why, how a pre-quantized checkpoint runs here or None), with
    the convention locked for this process and `--quantize fp8`'s layers swapped in."""
    from workers.quant.fp8_convention import choose_fp8, lock_convention

    conv, reason = choose_fp8(bound.type, cap)
    lock_convention(conv)
    checkpoint = None
    if loaded.quantization is not None:  # pre-quantized: the stored bytes in this device's execution
        from workers.quant.prepare import prepare_fp8_checkpoint

        checkpoint = prepare_fp8_checkpoint(loaded.model, conv, bound.type, cap)
    if config.quantize == "fp8":
        from workers.quant.quantize_model import quantize_model

        logger.info("fp8 weights: %s", quantize_model(loaded.model, conv))
    logger.info("fp8 convention %s: %s", conv.name, reason)
    return conv, reason, checkpoint


def _join_pipeline(plan, config: WorkerConfig, bound, loaded, stages):
    """This stage's link in the replica's process group, through the rendezvous the first stage made
    for this start (the first stage fails as soon as a stage exits)."""
    import torch

    from workers.pipeline.rendezvous import Rendezvous
    from workers.pipeline.transport import StageLink

    rendezvous = stages.rendezvous if stages is not None else Rendezvous.read(config.pipeline_plan)

    def join():
        return StageLink.join(plan, config.pipeline_rank, torch.device(bound.torch_device), loaded.dtype, rendezvous)

    return join() if stages is None else stages.wait_for(join)


def _serve_stage(status: StatusFile, bound, loaded, kernels, fp8: dict, cpu, link, kv) -> int:
    """A stage after the first: its loop until the pipeline stops (workers/pipeline/follower.py)."""
    from workers.pipeline.follower import serve_stage
    from workers.pipeline.metrics import StageClock

    status.write(WorkerStatus.READY, stage=link.rank)

    def report(clock: StageClock) -> None:  # read by the first stage's /metrics and its timing records
        status.write(WorkerStatus.READY, stage=link.rank, **clock.figures())

    clock = StageClock(report, host_cpu=bound.simulated or bound.type == "cpu")
    serve_stage(bound, loaded, kernels, fp8, link, kv, cpu.in_place, clock)
    status.write(WorkerStatus.STOPPED, stage=link.rank, **clock.figures())  # its last figures, for the records
    return ExitCode.OK
