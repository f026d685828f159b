"""The engine built for one bound device: the CPU's own paths, the KV cache, the engine, its compiled step.

Design: workers/main.py runs these in the mission's order once the model is loaded, kernelized
and in its fp8 convention, each inside a startup step so that the status file says which one
failed: `install_cpu_paths` (a CPU's packed projections, deterministic numerics, its C++ kernels
and decode attention), `decide_compile` and `build_kv` (the paged cache sized for this device),
`build_engine` (runner, scheduler, grammars) and, once the server is built, `BuiltEngine.compile`.
Each takes the worker's `WorkerConfig` and its `BoundDevice` as arguments and returns what it made
as a value, which `/capability` then describes (workers/engine/describe.py). A pipeline's first
stage builds its runner and engine from the same pieces (`scheduler_config`, `grammars_for`;
workers/pipeline/first.py). Trade-off: the steps hand each other plain values rather than sharing
one object's state, so a step's inputs are spelled at each call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kernels_local.cpp_build import CppKernel, build_deferred, deferring, forget_deferred
from kernels_local.paged_attention import cpu as cpu_decode
from kernels_local.panel_linear import cpu as cpu_gemm
from workers.contract import WorkerConfig
from workers.contract.gguf_rule import GGUF_EXACT
from workers.device.bind import BoundDevice
from workers.engine.compiled import (
    CompiledDecode,
    CompileDecision,
    decide,
    decode_buckets,
    scheduler_shapes,
    warm_or_eager,
)
from workers.engine.core import Engine
from workers.engine.kv_cache import build_kv_cache
from workers.engine.mtp import mtp_drafter
from workers.engine.openmp import pool_released
from workers.engine.runner import ModelRunner
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.speculate import speculator_for
from workers.engine.warm_caches import ChildCompile, fill_caches, use_inductor_cache
from workers.kv.hashing import root_hash
from workers.kv.pool import KVPool
from workers.kvtier.tier import HostTier
from workers.model.cpu_projections import PACKED_DTYPES, install_cpu_projections
from workers.model.deterministic import DeterministicPlan, enable_deterministic
from workers.model.loader import LoadedModel
from workers.sampling.grammar import CompileBudget, Grammars

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuPaths:
    """What a model computing on the CPU runs besides torch's own ops, and why (`/capability`)."""

    deterministic: DeterministicPlan | None = None  # --deterministic: fixed row tiles and attention splits
    kernels: dict[str, str] = field(default_factory=dict)  # each C++ kernel's state, by its stem
    in_place: bool = False  # decode rows attend through the C++ kernel, reading the pool in place
    decode_attention: str | None = None  # why (None: not a CPU model, or deterministic mode)
    # C++ kernels not in the cache yet, left to build behind the serving (`install_cpu_paths(behind=True)`)
    pending: dict[str, tuple] = field(default_factory=dict, compare=False)


def context_length(config: WorkerConfig, loaded: LoadedModel) -> int:
    """The longest sequence served: the checkpoint's context, capped by `--max-model-len`."""
    context = loaded.config.context_length
    return min(context, config.max_model_len) if config.max_model_len else context


def install_cpu_paths(loaded: LoadedModel, bound: BoundDevice, deterministic: bool,
                      behind: bool = False) -> CpuPaths:
    """A CPU model's projections through their packs (then, `deterministic`, in fixed row tiles over
    them: workers/model/cpu_projections.py says why that stays exact), its C++ kernels built and
    loaded now rather than inside the first request (kernels_local/cpp_build.py `CppKernel`), and
    whether its decode rows read the KV pool in place (kernels_local/paged_attention/cpu.py).
    `behind` (a CPU worker serving first): the kernels not in the cache yet are not built now: their
    torch paths serve, and `CpuPaths.pending` lists them for `BuiltEngine` to build behind the serving
    and swap in between two steps (the same call again, without `behind`)."""
    if behind and not deterministic and bound.torch_device.split(":")[0] == "cpu":
        with deferring() as pending:
            paths = install_cpu_paths(loaded, bound, deterministic)
        if pending:
            logger.info("C++ kernels %s are not built on this host yet: serving on their torch paths first; they "
                        "build behind the serving (a minute or two on a small host, once per host) and join "
                        "between two steps", ", ".join(sorted(k[0] for k in pending.values())))
        return CpuPaths(paths.deterministic, paths.kernels, paths.in_place, paths.decode_attention, dict(pending))
    if bound.torch_device.split(":")[0] == "cpu":
        build_cpu_kernels(loaded.dtype, deterministic)
    done = install_cpu_projections(loaded.model, bound.torch_device, loaded.dtype, experts=not deterministic)
    if done.layers:
        logger.info("CPU %s projections (%d layers): %s", loaded.dtype, done.layers, done.reason)
    plan = enable_deterministic(loaded.model) if deterministic else None
    if bound.torch_device.split(":")[0] != "cpu":
        return CpuPaths(plan)
    kernels = {kernel.stem: kernel.load().reason for kernel in list(CppKernel.made)}  # every copy (see `made`)
    logger.info("CPU kernels: %s", "; ".join(f"{k}: {v}" for k, v in kernels.items()))
    if plan is not None:  # deterministic mode has its own split attention
        return CpuPaths(plan, kernels)
    state = cpu_decode.load()
    logger.info("decode attention on the CPU: %s", state.reason)
    return CpuPaths(plan, kernels, state.available, state.reason)


def build_cpu_kernels(dtype, deterministic: bool) -> None:
    """Build (or load) the C++ kernels a CPU worker loads at start side by side, one per core: each
    build is a compiler child, so a cold host pays about its longest build rather than their sum.
    The callers' own `load()` then finds each state made (kernels_local/cpp_build.py)."""
    loaders = [] if deterministic else [cpu_decode.load]  # the longest build first: the others share the other core
    if dtype in PACKED_DTYPES:
        loaders.append(cpu_gemm.load)
    loaders += [kernel.load for kernel in list(CppKernel.made)]
    with ThreadPoolExecutor(max(1, min(len(loaders), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda load: load(), loaders))


def decide_compile(config: WorkerConfig, bound: BoundDevice, cpu: CpuPaths, model, pipeline: bool) -> CompileDecision:
    """The `--compile` decision for this device and model (workers/engine/compiled.py `decide`); a
    pipeline's stages run every step eager (the first stage's runner sends each step on)."""
    if pipeline:
        decision = CompileDecision(config.compile, False, None, "a pipeline stage: every step eager (each step is "
                                                                "sent on to the next stage)")
    elif config.speculative == "mtp":
        decision = CompileDecision(config.compile, False, None, "--speculative mtp: every step eager (the MTP head "
                                                                "drafts from each step's hidden states)")
    else:
        decision = decide(config.compile, bound.torch_device.split(":")[0], bound.simulated,
                          cpu.deterministic is not None, model)
    logger.info("decode step: %s", decision.reason)
    return decision


def build_kv(config: WorkerConfig, bound: BoundDevice, loaded: LoadedModel, context: int, compile_enabled: bool,
             agree: Callable[[list[int]], list[int]] | None = None) -> KVPool:
    """The paged KV cache for this worker, or with `agree` (a pipeline's stages settling each group's
    blocks together) for this stage's own layers (workers/engine/kv_cache.py)."""
    stage = None if agree is None else loaded.model.stage
    kv, shape, budget, why = build_kv_cache(config, bound, loaded, context, compile_enabled, stage, agree)
    if agree is not None and loaded.model.stage[0] > 0:  # a later stage: no prefix cache of its own
        logger.info("KV cache %s bytes: %s; budget %s (%s)", kv.nbytes, shape, budget, why)
    else:
        logger.info("KV cache %s bytes: %s; budget %s (%s); prefix cache %s", kv.nbytes, shape, budget, why,
                    "off" if config.no_prefix_cache or (kv.states is not None and
                                                        kv.states.num_slots <= config.max_batch) else "on")
    return kv


def numerics(config: WorkerConfig) -> tuple[str, ...]:
    """What of the configuration, beside the model and dtype, decides a KV block's values (the prefix
    cache's and host tier's hash root): the quantization, and a GGUF file's rounded activations."""
    if config.gguf_activations == GGUF_EXACT:
        return (config.quantize,)
    return config.quantize, f"gguf-activations-{config.gguf_activations}"


def scheduler_config(config: WorkerConfig, loaded: LoadedModel, kv: KVPool, context: int,
                     shapes: tuple[tuple[int | None, int], ...], state_slots: int) -> SchedulerConfig:
    """The scheduler's limits: the worker's flags, the KV groups' `shapes`, and the prefix cache's
    hash root (what besides the tokens decides a block's contents); the state pool's slots past the
    `state_slots` running ones hold snapshots (workers/kv/snapshots.py) where one full group is."""
    root = root_hash(loaded.model_id, loaded.dtype, *numerics(config), config.kv_block_size)
    spare = kv.states.num_slots - state_slots if state_slots and kv.states is not None else 0
    snapshots = spare if len(shapes) == 1 and shapes[0][0] is None else 0
    return SchedulerConfig(
        config.max_batch, context, shapes[0][1], kv.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens, prefix_caching=not config.no_prefix_cache,
        eos_token_ids=loaded.eos_token_ids, cache_root=root, rope=loaded.model.rope_policy, kv_groups=shapes,
        state_slots=state_slots, state_snapshots=snapshots,
    )


def grammars_for(config: WorkerConfig, loaded: LoadedModel) -> Grammars:
    """The grammar engine, masking the logits' full width (the model's vocab may pad the tokenizer's)."""
    return Grammars.for_tokenizer(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids,
                                  config.threads or 1, CompileBudget.from_config(config))


@dataclass
class BuiltEngine:
    """The engine over its KV cache, and its decode step compiled per bucket (None: every step eager)."""

    engine: Engine
    kv: KVPool
    decision: CompileDecision
    compiled: CompiledDecode | None = None
    behind: threading.Thread | None = None  # the compile running behind the serving, if any
    cpu: CpuPaths = field(default_factory=CpuPaths)  # the CPU paths in use (swapped once kernels built behind)
    reinstall: Callable[[], CpuPaths] | None = None  # installs the CPU paths again (kernels built behind)
    # each layer (C++ kernel, "decode step") whose kernel failed on this device -> why its torch path serves
    fallbacks: dict[str, str] = field(default_factory=dict)
    building: tuple[str, ...] = ()  # the C++ kernels building behind the serving right now
    child: ChildCompile | None = None  # compiles the buckets into the caches first (workers/engine/warm_caches.py)
    child_done: int | None = None  # buckets the child compiled (None: no child running)

    def preparing(self) -> list[str]:
        """What still builds or compiles behind the serving, one line each (`/capability` `preparing`)."""
        lines = [f"C++ kernels: torch paths, building {', '.join(self.building)}"] if self.building else []
        c = self.compiled
        if c is not None and self.behind is not None and c.state in ("waiting", "compiling"):
            n = len(c.buckets)
            if self.building:
                lines.append(f"decode step: eager, {n} buckets compile once the C++ kernels are built")
            elif self.child_done is not None:
                lines.append(f"decode step: eager, compiling {min(self.child_done + 1, n)} of {n} buckets "
                             "(in a child process)")
            else:
                lines.append(f"decode step: eager, compiling {min(c.done + 1, n)} of {n} buckets")
        return lines

    def fell_back(self, failed: dict[str, str]) -> None:
        """`failed` (layer -> why) now run their torch paths: `fallbacks`, and `/metrics`."""
        if failed:
            self.fallbacks.update(failed)
            self.engine.metrics.fell_back(failed)

    def compile(self, on_change: Callable[[], None] = lambda: None) -> str:
        """Compile (CPU) or capture (GPU) the decode step of every bucket (the `compile` startup
        step); what it did, in one line. `auto` and compiling failed: every step eager.

        Under `--compile auto` a CPU worker compiles in the background (`background`): it serves
        eager at once; a child process compiles every bucket into the on-disk caches (`child`,
        workers/engine/warm_caches.py), then the worker compiles each, finding it there, and its
        steps wait only while one bucket loads and runs (the model's layers are not safe to run
        from two threads at once: `Engine.steps_held`); they take the compiled decode once every
        bucket is done, so a first start answers in seconds instead of after minutes of
        Inductor. `on` compiles before
        ready, as asked, and CUDA/HIP graphs are captured before ready (a capture cannot share its
        stream with steps; it takes seconds). `on_change` is called when the state changes."""
        if self.cpu.pending:  # the C++ kernels build first, then the compile (if any) runs behind too
            if self.compiled is not None and self.background:
                logger.info("Inductor cache %s", use_inductor_cache())
                self.compiled.prepare()
                self.compiled.state = "compiling"
            self.building = tuple(sorted(k[0] for k in self.cpu.pending.values()))
            said = (f"C++ kernels ({len(self.cpu.pending)}) building in the background, then "
                    + (f"{self.compiled.backend}, buckets {list(self.compiled.buckets)}" if self.background
                       else "no compile: " + self.decision.reason) + "; steps run eager until it is done")
            return self._start_behind(self._kernels_behind, on_change, said)
        if self.compiled is None:
            return self.decision.reason
        if self.compiled.backend == "inductor":  # beside this architecture's Triton cache
            logger.info("Inductor cache %s", use_inductor_cache())
        if self.background:
            self.compiled.prepare()
            self.compiled.state = "compiling"
            said = (f"{self.compiled.backend}, buckets {list(self.compiled.buckets)}: compiling in the background; "
                    "steps run eager until it is done")
            return self._start_behind(self._compile_behind, on_change, said)
        self._finish(warm_or_eager(self.decision, self.compiled))
        on_change()
        if not self.decision.enabled:
            return self.decision.reason
        return f"{self.compiled.backend}, buckets {list(self.compiled.buckets)} in {self.compiled.seconds:.1f}s"

    def _start_behind(self, target: Callable[[Callable[[], None]], None], on_change: Callable[[], None],
                      said: str) -> str:
        """Start `target` behind the serving; `said`, formed before: a compile that fails at once drops
        `compiled` in that thread, at times before this returns."""
        def behind() -> None:
            with pool_released():  # its OpenMP pool would slow the engine thread's regions
                target(on_change)

        self.behind = threading.Thread(target=behind, name="hetserve-compile", daemon=True)
        self.behind.start()
        return said

    @property
    def background(self) -> bool:
        return self.compiled is not None and self.compiled.backend == "inductor" and self.decision.mode == "auto"

    def _kernels_behind(self, on_change: Callable[[], None]) -> None:
        """The background thread of a worker that serves first: build the C++ kernels left for
        later (compiler children: this interpreter stays free), swap them in while no step runs
        (`Engine.steps_held`: the projections laid out again for the panel GEMM, decode rows read
        the pool in place), then compile the decode step behind the serving as usual."""
        started, pending = time.monotonic(), self.cpu.pending
        failed = {pending[k][0]: why for k, why in build_deferred(pending, os.cpu_count() or 1).items() if why}
        held = self.engine.steps_held() if self.reinstall is not None else contextlib.nullcontext()
        with held:
            forget_deferred()
            if self.reinstall is not None:
                self.cpu = self.reinstall()
                runner = self.engine.runner
                if runner.mirror is None:  # no decode mirror to keep in step: rows may read the pool in place
                    runner.in_place = self.cpu.in_place
                    if self.compiled is not None:
                        self.compiled.attend_in_place(self.cpu.in_place)
        self.building = ()
        self.fell_back({name: f"its C++ build failed: {why}" for name, why in failed.items()})
        logger.info("C++ kernels built behind the serving in %.0f s%s; steps use them from now on",
                    time.monotonic() - started, f" ({len(failed)} failed: {failed})" if failed else "")
        on_change()
        if self.compiled is not None and self.background:
            self._compile_behind(on_change)

    def _compile_behind(self, on_change: Callable[[], None]) -> None:
        """The background compile's thread: the engine's steps go on meanwhile (eager). With a
        `child`, it compiles every bucket into the on-disk caches first, with no step held; the
        worker's own compile of each bucket is then a cache hit (a child that fails: a full
        compile here, as without one)."""
        if self.child is not None:
            def progress(done: int) -> None:
                self.child_done = done
                on_change()

            self.child_done = 0
            on_change()
            why = fill_caches(self.child, self.compiled.in_place, progress)
            self.child_done = None
            if why is not None:
                logger.info("decode step: %s; compiling in the worker instead", why)
        self._finish(warm_or_eager(self.decision, self.compiled, self.engine.steps_held, on_bucket=on_change))
        if self.decision.enabled:
            logger.info("decode step: %s, buckets %s compiled in the background in %.1fs; steps use it from now on",
                        self.compiled.backend, list(self.compiled.buckets), self.compiled.seconds)
        on_change()

    def _finish(self, decision: CompileDecision) -> None:
        """`decision` after the compile; failed (under `auto`): eager from now on. The runner keeps
        a failed compile it may be reading on the engine thread: one not `ready` is never run."""
        if self.decision.enabled and not decision.enabled:  # the compile (or capture) failed: eager steps
            self.fell_back({"decode step": decision.reason})
        self.decision = decision
        if not decision.enabled:
            if not self.background:
                self.engine.runner.compiled = None
            self.compiled = None


def build_engine(config: WorkerConfig, bound: BoundDevice, loaded: LoadedModel, kv: KVPool,
                 decision: CompileDecision, cpu: CpuPaths, context: int) -> BuiltEngine:
    """The engine of a worker that serves the whole model: its runner (with the compiled decode
    step per bucket where decided; the scheduler never hands out its scratch blocks), scheduler and
    grammars."""
    compiled, shapes = None, kv.group_shapes
    if decision.enabled:
        shapes = scheduler_shapes(kv)
        compiled = CompiledDecode(loaded.model, kv, bound.torch_device, decode_buckets(config.max_batch),
                                  decision.backend, in_place=cpu.in_place)
    runner = ModelRunner(loaded.model, kv, bound.torch_device, mirror=cpu.deterministic is None, compiled=compiled,
                         in_place=cpu.in_place)
    slots = config.max_batch if kv.states is not None else 0  # the rest of the state pool holds snapshots
    scheduler = Scheduler(scheduler_config(config, loaded, kv, context, shapes, slots))
    exact = cpu.deterministic is not None  # the only mode whose verify step rounds as the decode step does
    speculator = speculator_for(config.speculative, config.num_speculative_tokens, scheduler, exact=exact,
                                mtp=mtp_drafter(loaded) if config.speculative == "mtp" else None)
    engine = Engine(runner, scheduler, loaded.tokenizer, max_queue=config.max_queue,
                    grammars=grammars_for(config, loaded), speculator=speculator)
    sched = engine.scheduler.config

    def chain_root_for(dtype) -> bytes:  # the prefix cache's root, had the KV been of `dtype` (as above)
        return root_hash(loaded.model_id, dtype, *numerics(config), config.kv_block_size)

    engine.attach_tier(HostTier.for_worker(config, kv, sched.cache_root, sched.prefix_caching, loaded.model_dir,
                                           chain_root_for))
    reinstall = None
    if cpu.pending:
        def reinstall() -> CpuPaths:
            return install_cpu_paths(loaded, bound, False)
    child = None  # under `auto` a CPU worker's buckets compile in a child process first (not with LoRA hooks)
    if compiled is not None and decision.backend == "inductor" and decision.mode == "auto" and not config.lora:
        child = ChildCompile(config, kv.groups, kv.block_size, compiled.buckets,
                             kv.states.num_slots if kv.states is not None else 0)
    return BuiltEngine(engine, kv, decision, compiled, cpu=cpu, reinstall=reinstall, child=child)
