"""The serve step: paged KV cache, engine, HTTP app and uvicorn on the worker's Unix socket.

`WorkerServer` is built by the worker's last startup step from one `Startup` value: what the
earlier steps produced (the bound device, the loaded model, its kernel choices, the fp8
convention with its reason, the preflight). Its constructor orchestrates small `_init_*`
steps (row buckets or deterministic numerics, the `--compile` decision, the KV cache sized
for this device, the engine, the app, uvicorn); `compile()` (the `compile` startup step)
compiles or captures the decode step per batch bucket (workers/engine/compiled.py); `run()`
serves until SIGTERM or a fatal engine error and `close()` frees the socket. The socket is created 0600 (only the router, as the same user, reaches it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from kernels_local.mapping import KernelChoice
from workers.contract import DRAIN_TIMEOUT_S, ENV_TRITON_CACHE_DIR, CapabilityPayload
from workers.contract.payload import CompileDescription
from workers.contract.tracing import start_tracing
from workers.device.bind import BoundDevice
from workers.kernelize.records import Preflight
from workers.model.loader import LoadedModel
from workers.quant.fp8_convention import Fp8Convention

logger = logging.getLogger(__name__)


def bind_unix_socket(path: str) -> socket.socket:
    """A listening Unix socket that is 0600 from its creation (umask), never world-reachable."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if p.is_socket():
            p.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(p))
    finally:
        os.umask(old)
    os.chmod(p, 0o600)
    sock.listen(2048)
    return sock


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("hetserve", "torch", "triton", "kernels"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _loop_factory():
    """uvloop's event loop where it is installed (less CPU per request and per streamed event
    than asyncio's own; uvicorn's `loop="auto"` cannot choose it for a loop we start), else
    asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


@dataclass(frozen=True, eq=False)
class Startup:
    """What the mission's steps produced, handed to the serve step as one value."""

    args: argparse.Namespace  # the worker's command line (`python -m workers --help`)
    bound: BoundDevice  # bind
    loaded: LoadedModel  # load
    kernels: dict[str, KernelChoice]  # kernelize: one choice per layer
    fp8: Fp8Convention  # fp8
    fp8_reason: str
    preflight: Preflight | None = None  # kernelize, where the preflight ran
    fp8_checkpoint: dict | None = None  # fp8, a pre-quantized checkpoint: its execution here (workers/quant/prepare.py)
    pipeline: tuple | None = None  # the first stage of a pipeline: (its `StageLink`, the other `Stages`)


class WorkerServer:
    """KV cache + engine + HTTP app + uvicorn on the Unix socket: built by the serve step."""

    def __init__(self, startup: Startup):
        self.startup = startup
        self.args, self.bound, self.loaded = startup.args, startup.bound, startup.loaded
        self.link, self.stages = startup.pipeline or (None, None)
        self._pipeline_error: BaseException | None = None
        self._init_projections()
        self._init_cpu_kernels()
        self._init_decode_attention()
        self._init_compile()
        self._init_kv_cache()
        self._init_engine()
        self._init_app()
        self._init_server()
        if self.stages is not None:  # from here on, a stage that exits stops this replica
            self.stages.watch(self._stage_exited)

    def _init_projections(self) -> None:
        """A CPU's projections through their packs, then, with --deterministic, in fixed row tiles
        over them (each tile one shape: workers/model/cpu_projections.py says why that stays exact)."""
        from workers.model.cpu_projections import install_cpu_projections

        self.deterministic = None
        deterministic = getattr(self.args, "deterministic", False)
        done = install_cpu_projections(self.loaded.model, self.bound.torch_device, self.loaded.dtype,
                                       experts=not deterministic)
        if done.layers:
            logger.info("CPU %s projections (%d layers): %s", self.loaded.dtype, done.layers, done.reason)
        if deterministic:
            from workers.model.deterministic import enable_deterministic

            self.deterministic = enable_deterministic(self.loaded.model)

    def _init_cpu_kernels(self) -> None:
        """Where the model computes on the CPU, its C++ kernels (RMSNorm, SiluAndMul, the rotary, the
        greedy rows: kernels_local/cpp_build.py `CppKernel`) built and loaded now, at start (a few
        seconds once per host), not inside the first request; `cpu_kernels`: each one's state by name."""
        self.cpu_kernels: dict[str, str] = {}
        if self.bound.torch_device.split(":")[0] != "cpu":
            return
        from kernels_local.cpp_build import CppKernel

        for kernel in list(CppKernel.made):  # every copy (the kernels library imports repositories anew)
            self.cpu_kernels[kernel.stem] = kernel.load().reason
        logger.info("CPU kernels: %s", "; ".join(f"{k}: {v}" for k, v in self.cpu_kernels.items()))

    def _init_decode_attention(self) -> None:
        """Whether decode rows on this device's CPU tensors attend through the C++ kernel, reading
        the pool in place (kernels_local/paged_attention/cpu.py; the first worker on a host builds
        it), and why."""
        self.in_place, self.decode_attention = False, None
        if self.bound.torch_device.split(":")[0] != "cpu" or self.deterministic is not None:
            return  # a GPU's kernels read in place already; deterministic mode has its own split path
        from kernels_local.paged_attention import cpu as cpu_decode

        state = cpu_decode.load()
        self.in_place, self.decode_attention = state.available, state.reason
        logger.info("decode attention on the CPU: %s", state.reason)

    def _init_compile(self) -> None:
        from workers.engine.compiled import decide

        device = self.bound.torch_device
        self.compile_decision = decide(getattr(self.args, "compile", "off"), device.split(":")[0],
                                       self.bound.simulated, self.deterministic is not None, self.loaded.model)
        logger.info("decode step: %s", self.compile_decision.reason)

    @property
    def context_length(self) -> int:
        """The longest sequence served: the checkpoint's context, capped by `--max-model-len`."""
        cap = getattr(self.args, "max_model_len", None)
        return min(self.loaded.config.context_length, cap) if cap else self.loaded.config.context_length

    def _init_kv_cache(self) -> None:
        from workers.engine.kv_cache import build_kv_cache

        stage = None if self.link is None else self.loaded.model.stage
        agree = None if self.link is None else self.link.agree_blocks
        self.kv, shape, budget, why = build_kv_cache(self.args, self.bound, self.loaded, self.context_length,
                                                     self.compile_decision.enabled, stage, agree)
        state = self.kv.states is not None
        logger.info("KV cache %s bytes: %s; budget %s (%s); prefix cache %s", self.kv.nbytes, shape, budget, why,
                    "off" if self.args.no_prefix_cache or state else "on")

    def _init_engine(self) -> None:
        from workers.engine.core import Engine
        from workers.engine.runner import ModelRunner
        from workers.engine.scheduler import Scheduler, SchedulerConfig
        from workers.kv.hashing import root_hash
        from workers.sampling.grammar import CompileBudget, Grammars

        args, loaded = self.args, self.loaded
        # What besides the tokens decides a block's contents: the prefix cache's hash root.
        root = root_hash(loaded.model_id, loaded.dtype, args.quantize, args.kv_block_size)
        self.compiled, shapes = None, self.kv.group_shapes
        if self.compile_decision.enabled:  # the scheduler never hands out the scratch blocks
            from workers.engine.compiled import CompiledDecode, decode_buckets, scheduler_shapes

            shapes = scheduler_shapes(self.kv)
            self.compiled = CompiledDecode(loaded.model, self.kv, self.bound.torch_device,
                                           decode_buckets(args.max_batch), self.compile_decision.backend,
                                           in_place=self.in_place)
        config = SchedulerConfig(
            args.max_batch, self.context_length, shapes[0][1], self.kv.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens, prefix_caching=not args.no_prefix_cache,
            eos_token_ids=loaded.eos_token_ids, cache_root=root, rope=loaded.model.rope_policy,
            kv_groups=shapes, state_slots=self._state_slots(),
        )
        if self.link is not None:  # the first stage of a pipeline (workers/pipeline/runner.py)
            from workers.pipeline.metrics import StageClock, TimingRecorder
            from workers.pipeline.runner import PipelineRunner

            clock = StageClock(lambda _: self.recorder.record(), self.bound.simulated or self.bound.type == "cpu")
            self.recorder = TimingRecorder(self.stages.plan, clock, self.stages.status_files())
            runner = PipelineRunner(loaded.model, self.kv, self.bound.torch_device, self.link, args.worker_id,
                                    getattr(args, "pipeline_microbatches", None), clock, self.in_place)
        else:
            runner = ModelRunner(loaded.model, self.kv, self.bound.torch_device, worker_id=args.worker_id,
                                 mirror=self.deterministic is None, compiled=self.compiled, in_place=self.in_place)
        # The grammar engine masks the logits' full width (the model's vocab may pad the tokenizer's).
        grammars = Grammars.for_tokenizer(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids,
                                          args.threads or 1, CompileBudget.from_args(args))
        kind, extra = Engine, {}
        if self.link is not None:  # several batches in flight through the stages (workers/pipeline/engine.py)
            from workers.pipeline.engine import PipelineEngine

            kind, extra = PipelineEngine, {"batches": getattr(args, "pipeline_batches", None) or self.link.world}
        self.engine = kind(runner, Scheduler(config), loaded.tokenizer, max_queue=args.max_queue,
                           on_fatal=self._on_fatal, grammars=grammars, **extra)
        if self.link is not None:  # each stage's own steps beside the engine's series
            from workers.pipeline.metrics import StageMetrics

            self.engine.metrics.registry.register(StageMetrics(runner.clock, self.stages.status_files()))

    def _init_app(self) -> None:
        from workers.model.describe import describe
        from workers.serving.app import create_app

        loaded, kv, startup = self.loaded, self.kv, self.startup
        preflight = startup.preflight
        described = describe(loaded.config)  # architecture, features, attention per layer type
        model = {"id": loaded.model_id, "dtype": str(loaded.dtype).removeprefix("torch."),
                 "context_length": self.context_length, "architecture": described["architecture"],
                 "features": described["features"], "attention": described["attention"]}
        for key in ("chat_template", "eos_token", "bos_token"):
            if getattr(loaded, key) is not None:
                model[key] = getattr(loaded, key)
        # The model's recommended sampling (generation_config.json), which the OpenAI routes
        # apply to fields a request leaves out, as vLLM does.
        model["sampling_defaults"] = {
            k: loaded.generation_config[k]
            for k in ("temperature", "top_p", "top_k", "repetition_penalty")
            if isinstance(loaded.generation_config.get(k), (int, float))
        }
        kernel_info = {k: v.to_dict() for k, v in startup.kernels.items()}
        if self.decode_attention is not None and "PagedAttention" in kernel_info:  # what its CPU tensors run
            kernel_info["PagedAttention"]["cpu_decode"] = self.decode_attention
        from kernels_local.activation import cpu as activation
        from kernels_local.rmsnorm import cpu as rmsnorm

        for layer, stem in (("RMSNorm", rmsnorm.KERNEL.stem), ("SiluAndMul", activation.KERNEL.stem)):
            if layer in kernel_info and kernel_info[layer]["variant"] == "cpp" \
                    and stem in self.cpu_kernels:  # whether its C++ built here, and why not
                kernel_info[layer]["cpu_kernel"] = self.cpu_kernels[stem]
        fp8 = {"convention": startup.fp8.name, "reason": startup.fp8_reason, **self._fp8_use()}
        if startup.fp8_checkpoint is not None:  # how this device runs the checkpoint's fp8 layers, and why
            fp8["checkpoint"] = {**startup.fp8_checkpoint, "quantization": loaded.quantization}
        if preflight is not None:  # each layer's compile record; why native fp8 is not used, if so
            for layer, entry in kernel_info.items():
                entry["compiled"] = preflight.layers[layer].compiled()
            if preflight.native_fp8 is not None:
                fp8["native_compile"] = preflight.native_fp8.to_dict()
        info = CapabilityPayload(
            worker_id=self.args.worker_id,
            device=self.bound.to_dict(),
            fp8=fp8,
            kernels=kernel_info,
            triton_cache=os.environ.get(ENV_TRITON_CACHE_DIR),
            capacity={**self.engine.scheduler.capacity(), "kv_cache_bytes": kv.nbytes,
                      "kv_groups": [{"window": g.window, "layers": len(g.layers), "blocks": g.num_blocks,
                                     "kv_heads": g.kv_heads, "head_dim": g.head_dim} for g in kv.groups],
                      **({"state_bytes": kv.states.nbytes} if kv.states is not None else {})},
            model=model,
            versions=_versions(),
            deterministic=self.deterministic.to_dict() if self.deterministic else None,
            compile=self._compile_description(),
            pipeline=self._pipeline_description(kernel_info, fp8),
        )
        self.info = info
        self.tracing = start_tracing(getattr(self.args, "otlp_endpoint", None), "hetserve-worker",
                                     {"service.instance.id": info.worker_id or ""})
        self.app = create_app(info, self.engine, loaded.tokenizer, tracing=self.tracing)

    def _state_slots(self) -> int:
        """Slots of the linear layers' state the scheduler hands out: this pool's, or in a pipeline
        (whose first stage may hold no linear layer) one per running sequence if any stage has them."""
        if self.link is not None:
            return self.args.max_batch if self.loaded.config.state_layers else 0
        return self.kv.states.num_slots if self.kv.states is not None else 0

    def _pipeline_description(self, kernels: dict, fp8: dict) -> dict | None:
        """A pipeline's stages as `/workers` shows them: this one, then what each other stage reported."""
        if self.link is None:
            return None
        from workers.pipeline.follower import describe_stage

        mine = describe_stage(0, self.bound, self.loaded, self.startup.kernels, fp8, self.kv)
        stages = self.link.gather(mine)
        return {"stages": stages, "backend": self.stages.plan.backend}

    def _stage_exited(self, reason: str) -> None:
        """A pipeline stage is gone: this replica stops serving, as on a fatal engine error."""
        logger.error("%s; the pipeline stops", reason)
        self._pipeline_error = RuntimeError(reason)
        self.server.should_exit = True

    def _fp8_use(self) -> dict:
        """`used`: whether any layer computes from fp8 bytes (`--quantize fp8`, an fp8 checkpoint);
        `label`: what the ready line, `X-Fp8-Convention` and the status page show: the convention
        when used, else `not used (<dtype>)`, so a device's fp8 capability never reads as fp8 on."""
        ckpt = self.startup.fp8_checkpoint
        from_checkpoint = ckpt is not None and (ckpt.get("layers", 0) + ckpt.get("expert_layers", 0)) > 0
        used = self.args.quantize == "fp8" or from_checkpoint
        if not used:
            return {"used": False, "label": f"not used ({str(self.loaded.dtype).removeprefix('torch.')})"}
        name = self.startup.fp8.name
        return {"used": True, "label": f"{name} (checkpoint, {ckpt['execution']})" if from_checkpoint else name}

    def _compile_description(self) -> CompileDescription:
        d = self.compile_decision
        return CompileDescription(mode=d.mode, enabled=d.enabled, backend=d.backend, reason=d.reason,
                                  **(self.compiled.describe() if self.compiled is not None else {}))

    def compile(self) -> str:
        """Compile (CPU) or capture (GPU) the decode step of every bucket (the `compile` startup
        step); what `/capability` then says of it, in one line."""
        if self.compiled is None:
            return self.compile_decision.reason
        from workers.engine.compiled import use_inductor_cache, warm_or_eager

        if self.compiled.backend == "inductor":  # beside this architecture's Triton cache
            logger.info("Inductor cache %s", use_inductor_cache())
        self.compile_decision = warm_or_eager(self.compile_decision, self.compiled)
        if not self.compile_decision.enabled:  # `auto` and compiling failed: every step eager
            self.engine.runner.compiled = self.compiled = None
            self.info.compile = self._compile_description()
            return self.compile_decision.reason
        self.info.compile = self._compile_description()
        return f"{self.compiled.backend}, buckets {list(self.compiled.buckets)} in {self.compiled.seconds:.1f}s"

    def _init_server(self) -> None:
        import uvicorn

        self.sock = bind_unix_socket(self.args.socket)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="on", proxy_headers=False,
                                timeout_graceful_shutdown=DRAIN_TIMEOUT_S)
        self.server = uvicorn.Server(config)
        self.app.state.ctx.stopping = lambda: self.server.should_exit  # the stream channels end then

    def _on_fatal(self, exc: BaseException) -> None:
        """Engine thread: the model failed; stop serving so the router restarts this worker."""
        self.server.should_exit = True

    @property
    def fatal_error(self) -> BaseException | None:
        return self.engine.fatal_error or self._pipeline_error

    def run(self, on_ready) -> None:
        async def serve():
            task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
            while not self.server.started and not task.done():
                await asyncio.sleep(0.01)
            if self.server.started:
                on_ready()
                logger.info("ready on %s", self.args.socket)
            await task

        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(serve())

    def close(self) -> None:
        self.engine.shutdown(0.0)
        if self.link is not None:  # the other stages stop after this one's last step
            with contextlib.suppress(Exception):  # a stage already gone: nothing to tell
                self.engine.runner.stop()
            self.stages.stop()  # each has reported its last figures as it left
            self.recorder.record(force=True)  # what the stages measured, for the next split
        self.tracing.shutdown()  # flush the last spans
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.args.socket)
