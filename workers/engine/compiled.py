"""A compiled decode step per batch-size bucket: Inductor on the CPU, CUDA/HIP graphs on GPUs.

Design: on a small model a decode step's time is the dispatch of a few hundred small ops, not
their arithmetic. A step whose chunks are each one sampling token is padded to the smallest
bucket that holds it (1, 2, 4, ... below --max-batch, then --max-batch) and runs that bucket's
callable: `Transformer.step` itself, over static inputs the bucket owns and one `ForwardBatch`
whose Python values are constants; pad rows read and write only each KV group's scratch block
(`scratch_groups`). On the CPU one full graph per bucket, its table width dynamic, serves every
length; on a GPU a graph per bucket, captured once the device is bound, replays for any length
up to the context. Every other step runs eager (workers/engine/runner.py). For Dynamo the step
keeps no per-step Python values and slices each layer's K/V from one flat view per group
(workers/kv/pool.py); compiled rows attend in place, without the CPU decode mirror.
Trade-off: a bucket computes up to twice the rows it needs (17 rows run as 32), and on the CPU
every row attends the longest row's table width (masked), for one call instead of hundreds;
compiling costs time at start (docs/benchmarks.md, "Compiled decode step")."""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from workers.contract import COMPILE_MODES
from workers.engine.cuda_graphs import CudaGraphs
from workers.engine.warm_caches import cache_misses, first_use
from workers.kv.batch import ForwardBatch, GroupBatch
from workers.kv.paged import PagedRows

logger = logging.getLogger(__name__)

MIN_WIDTH = 2  # the CPU graph's table width is dynamic from 2 blocks (Dynamo specializes a width of 1)


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `max_batch`, then `max_batch` itself."""
    if max_batch < 1:
        raise ValueError(f"`max_batch` must be >= 1, got `{max_batch}`")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `rows` rows, or None when none does."""
    return next((b for b in buckets if b >= rows), None)


@dataclass(frozen=True)
class CompileDecision:
    """Whether the worker compiles its decode step, how, and why (`/capability` `compile`)."""

    mode: str  # what was asked: auto | on | off
    enabled: bool
    backend: str | None  # "inductor" (CPU) | "cuda-graphs" (CUDA and ROCm) | None
    reason: str


def decide(mode: str, device_type: str, simulated: bool, deterministic: bool, model) -> CompileDecision:
    """The `--compile` decision for a bound device and a loaded model, with its reason.

    `auto` compiles where it was measured to help: CUDA/HIP graphs on a real GPU (the step's
    launches replay as one), and Inductor on a CPU worker that is not simulating a GPU
    (docs/benchmarks.md, "Compiled decode step"; on a GPU scripts/gpu_check.sh measures it). A
    simulated GPU stays eager under `auto`: it is how tests and demos run many workers on few
    cores, where compiling at every start costs more than it saves. `off` never compiles;
    deterministic mode never does (its fixed row tiles and attention splits are what it
    guarantees, and a compiled graph fuses and reorders them: `--deterministic` takes
    precedence over `--compile on`)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"Unknown compile mode `{mode}`. Allowed: {', '.join(COMPILE_MODES)}")
    backend = "inductor" if device_type == "cpu" else "cuda-graphs"
    if mode == "off":
        return CompileDecision(mode, False, None, "--compile off: every step eager")
    if deterministic:
        return CompileDecision(mode, False, None, "deterministic mode: its fixed GEMM tiles and attention splits "
                                                  "run eager (a compiled graph would fuse and reorder them)")
    unfit = unfit_reason(model, backend)
    if unfit is not None:
        if mode == "on":
            raise ValueError(f"`--compile on`: {unfit}. Allowed: --compile auto or off for this model")
        return CompileDecision(mode, False, None, f"eager: {unfit}")
    if mode == "on":
        return CompileDecision(mode, True, backend, f"--compile on: {_BACKEND_WHY[backend]}")
    if device_type != "cpu" and not simulated:
        return CompileDecision(mode, True, backend, f"auto, a real GPU: {_BACKEND_WHY[backend]}")
    if device_type == "cpu" and not simulated:
        return CompileDecision(mode, True, backend, f"auto, a CPU worker: {_BACKEND_WHY[backend]}")
    return CompileDecision(mode, False, None, "auto, a simulated GPU: eager (compiling would take tens of seconds "
                                              "per start of workers that share few cores; --compile on forces it)")


def warm_or_eager(decision: CompileDecision, compiled: CompiledDecode, held=contextlib.nullcontext,
                  on_bucket: Callable[[], None] = lambda: None) -> CompileDecision:
    """Warm `compiled` (the `compile` startup step). Under `--compile on` a failure fails the
    start; under `auto` it is logged and the worker serves eager: the decision returned says so."""
    try:
        compiled.warm(held, on_bucket)
        return decision
    except Exception as e:
        if decision.mode == "on":
            raise
        logger.exception("decode step: compiling failed; serving eager")
        return replace(decision, enabled=False, backend=None,
                       reason=f"auto, compiling failed ({type(e).__name__}: {str(e)[:200]}): eager")


_BACKEND_WHY = {
    "inductor": "torch.compile (Inductor) of the decode step per batch bucket",
    "cuda-graphs": "one CUDA/HIP graph of the decode step per batch bucket",
}


def unfit_reason(model, backend: str = "inductor") -> str | None:
    """Why `model`'s decode step cannot be compiled as one static graph by `backend`, or None.
    MoE experts compile under Inductor as one opaque op each (kernels_local/fused_moe/torch_path.py);
    a graph capture of the Triton experts, and quantized experts' per-expert loops, stay eager."""
    if getattr(model, "stage", None) is not None:
        return "a pipeline stage (its step hands its hidden states to the next stage's process)"
    if any(s.rope_type == "dynamic" for s in getattr(model, "rope_specs", ())):
        return ("its dynamic rotary's frequencies depend on each sequence's length "
                "(a table per length, chosen on the host)")
    if getattr(getattr(model, "config", None), "sparse_layers", ()):
        if backend != "inductor":
            return "its MoE layers group tokens by expert (data-dependent shapes; not captured in a graph yet)"
        quantized = sorted({name for m in model.modules() if (name := getattr(type(m), "kernel_layer_name", None))
                            in ("Fp8FusedMoE", "Mxfp4FusedMoE")})
        if quantized:
            return f"its quantized experts ({', '.join(quantized)}) loop over experts on the host"
    if getattr(getattr(model, "config", None), "state_layers", ()):
        return "its linear-attention layers keep a recurrent state per sequence (slots chosen per step, no pad slot)"
    if not hasattr(model, "step") or not hasattr(model, "config"):
        return "it has no `Transformer.step`"
    return None


def scratch_groups(groups):
    """KV groups with one more block each, the last: the scratch block pad rows use. Give the
    scheduler `num_blocks - 1` per group (`scheduler_shapes`), so it never hands it out."""
    return tuple(replace(g, num_blocks=g.num_blocks + 1) for g in groups)


def scheduler_shapes(kv) -> tuple[tuple[int | None, int], ...]:
    """(window, blocks) of each group of a pool made with `scratch_groups`, without its scratch block."""
    return tuple((w, n - 1) for w, n in kv.group_shapes)


class _Bucket:
    """One bucket's static inputs on the device and the `ForwardBatch` built over them.

    `data` [B * (3 + G + R)] int64 holds token ids, positions, lengths, each group's slots and,
    for a LongRoPE model (R = 1), the length each row is rotated for; `tables[g]` [B, W_max]
    each group's block tables (only the first `width` columns of a step are written; the
    kernels read no further than a row's length)."""

    def __init__(self, size: int, groups: int, max_width: int, block_size: int, max_pos: int,
                 device: torch.device, rope: bool = False, in_place: bool = False) -> None:
        self.size, self.block_size, self.max_pos, self.groups = size, block_size, max_pos, groups
        self.in_place = in_place
        self.data = torch.zeros(size * (3 + groups + int(rope)), dtype=torch.int64, device=device)
        self.rope_lens = self.data[(3 + groups) * size :] if rope else None
        self.tables = tuple(torch.zeros((size, max_width), dtype=torch.int64, device=device) for _ in range(groups))
        self.rows = torch.arange(size, device=device)
        self.lens = self.data[2 * size : 3 * size]
        self._batches: dict[int, ForwardBatch] = {}  # per table width
        self.full = self.batch(max_width)  # the batch a graph is captured over

    def slots(self, g: int) -> torch.Tensor:
        return self.data[(3 + g) * self.size : (4 + g) * self.size]

    def attend_in_place(self, in_place: bool) -> None:
        """Its batches made again, their rows attending in place (`in_place`) or by a gather."""
        if in_place != self.in_place:
            self.in_place = in_place
            self._batches.clear()
            self.full = self.batch(self.tables[0].shape[1])

    def batch(self, width: int) -> ForwardBatch:
        """The step over the first `width` columns of the block tables (made once per width)."""
        if width not in self._batches:
            self._batches[width] = self._make_batch(width)
        return self._batches[width]

    def _make_batch(self, width: int) -> ForwardBatch:
        b, n = self.size, width * self.block_size
        rows = [PagedRows(rows=self.rows, rows_start=0, block_tables=t[:, :width], seq_lens=self.lens, max_len=n,
                          mask=None, view=None, in_place=self.in_place) for t in self.tables]
        groups = tuple(GroupBatch(self.slots(g), rows[g], (), 0) for g in range(1, len(self.tables)))
        return ForwardBatch(input_ids=self.data[:b], positions=self.data[b : 2 * b], slot_mapping=self.slots(0),
                            logits_index=self.rows, decode=rows[0], prefills=(), block_size=self.block_size,
                            max_pos=self.max_pos, max_block=0, rope_lens=self.rope_lens, groups=groups)

    def fill(self, chunks, scratch: tuple[int, ...], min_width: int) -> int:
        """Copy `chunks` (one-token sampling chunks, at most `size`) in, the rest as pads over each
        group's scratch block; returns the table width written."""
        bs, pad = self.block_size, self.size - len(chunks)
        used = [c.start_pos // bs + 1 for c in chunks]
        width = max(min_width, *used) if used else min_width
        flat = [c.token_ids[0] for c in chunks] + [0] * pad
        flat += [c.start_pos for c in chunks] + [0] * pad
        flat += [c.start_pos + 1 for c in chunks] + [1] * pad
        tables = []
        for g, block in enumerate(scratch):
            own = [c.block_table if g == 0 or not c.seq.group_tables else c.seq.group_tables[g - 1] for c in chunks]
            flat += [t[c.start_pos // bs] * bs + c.start_pos % bs for t, c in zip(own, chunks, strict=True)]
            flat += [block * bs] * pad
            for t, u in zip(own, used, strict=True):
                tables.extend(t[:u])
                tables.extend([block] * (width - u))
            tables.extend([block] * (width * pad))
        if self.rope_lens is not None:  # each row's rotation length, as `ForwardBatch.build` computes it
            flat += [max(c.start_pos + 1, c.seq.rope_len) for c in chunks] + [1] * pad
        host = torch.tensor(flat + tables, dtype=torch.int64)
        self.data.copy_(host[: self.data.numel()], non_blocking=True)
        cut = self.data.numel()
        for t in self.tables:
            t[:, :width].copy_(host[cut : cut + self.size * width].view(self.size, width), non_blocking=True)
            cut += self.size * width
        return width


MODEL_STATE = "self._modules["  # where Dynamo names the guards on the model's submodules and weights


def own_code(fn: types.FunctionType) -> types.FunctionType:
    """`fn` over its own copy of its code object. Dynamo keeps compiled entries and their guards
    per code object, so a decode whose step is its own copy is looked up among its own buckets
    only, and never matches another model's graph in the same process (which the guards that
    `skip_model_state_guards` drops would otherwise tell apart)."""
    out = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__, out.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return out


def skip_model_state_guards(entries) -> list[bool]:
    """Dynamo's guards to keep: all but those on the model's submodules and their weights (about
    four in five of a step's, each evaluated on every call; their cost: benchmarks/compiled_guards.py).
    A worker's model is fixed once it is loaded, kernelized and packed, before compiling; the
    step's own inputs, the KV pool, the rotary tables and the model's plain attributes stay
    guarded."""
    return [not e.name.startswith(MODEL_STATE) for e in entries]


class CompiledDecode:
    """The decode step per bucket over one KV pool: `warm()` compiles (or captures) every bucket,
    `fits(chunks)` says whether a step's chunks can run here, `run(chunks)` returns their logits."""

    def __init__(self, model, kv, device: torch.device | str, buckets: tuple[int, ...], backend: str,
                 graphs=None, dynamo_backend: str = "inductor", in_place: bool = False) -> None:
        """`kv` must be made with `scratch_groups` (its last block in each group is the pads'
        scratch block); `backend` "inductor" or "cuda-graphs"; `graphs`: the device's graph
        API (default `CudaGraphs()`; tests pass a stand-in); `dynamo_backend`: what
        `torch.compile` lowers the CPU graph with (tests trace with "aot_eager": the same
        full graph and buckets, without Inductor's C++ code generation, minutes on 2 cores);
        `in_place`: CPU rows attend through the C++ kernel (kernels_local/paged_attention/cpu.py),
        not a gather."""
        if backend not in _BACKEND_WHY:
            raise ValueError(f"Unknown compile backend `{backend}`. Allowed: {', '.join(_BACKEND_WHY)}")
        self.model, self.kv, self.device, self.backend = model, kv, torch.device(device), backend
        self.buckets = tuple(sorted(buckets))
        self.scratch = tuple(g.num_blocks - 1 for g in kv.groups)
        bs = kv.block_size
        # a table has an entry per block of the sequence in every group, a sliding group's freed
        # ones included (placeholders), so the context, not the group's blocks, bounds its width
        self.max_width = -(-model.config.context_length // bs)
        self.min_width = MIN_WIDTH if backend == "inductor" else 1
        self.max_pos = model.config.context_length - 1
        rope = getattr(model, "rope_threshold", None) is not None  # LongRoPE (unfit_reason refuses dynamic)
        self.in_place = in_place
        self._buckets = {b: _Bucket(b, len(kv.groups), self.max_width, bs, self.max_pos, self.device, rope, in_place)
                         for b in self.buckets}
        self._runs: dict[int, object] = {}
        self._graphs, self._dynamo_backend = graphs, dynamo_backend
        self.seconds = 0.0
        self.held_max = 0.0  # the longest the steps waited on one bucket (`warm(held)`)
        self.cache_hits = 0  # buckets Inductor found compiled in its on-disk caches (workers/engine/warm_caches.py)
        self.state = "waiting"  # -> "compiling" -> "ready" | "failed" (see `describe`)
        # the step's body, without its `@torch.inference_mode()` (Dynamo cannot trace into it):
        # called under the engine's inference mode, over its own copy of the code (`own_code`)
        step = type(model).step
        self._step = types.MethodType(own_code(getattr(step, "__wrapped__", step)), model)

    def attend_in_place(self, in_place: bool) -> None:
        """Rows attend through the C++ kernel (`in_place`) or by a gather from now on; only before
        `warm()` (the C++ kernel built behind the serving, before the compile)."""
        if self._runs:
            raise RuntimeError("`attend_in_place` after buckets compiled: they keep how they attend")
        self.in_place = in_place
        for bucket in self._buckets.values():
            bucket.attend_in_place(in_place)

    # -- start-up ----------------------------------------------------------------------------

    def warm(self, held=contextlib.nullcontext, on_bucket: Callable[[], None] = lambda: None) -> float:
        """Compile (Inductor) or capture (graphs) every bucket, largest first; returns seconds.
        Steps may run eager on another thread between buckets (`ready` stays False until every
        bucket is done): `held()` holds them while a bucket compiles and runs, which touches the
        pool's scratch blocks only, but the model's layers too; the rotary tables are grown
        first (`prepare`). `on_bucket` is called after each bucket."""
        t0 = time.perf_counter()
        self.state = "compiling"
        try:
            with torch.inference_mode():
                self.prepare()
                if self.backend == "inductor":
                    self._compile_all(held, on_bucket)
                else:
                    self._capture_all()
        except BaseException:
            self.state = "failed"
            raise
        self.seconds = time.perf_counter() - t0
        self.state = "ready"
        logger.info("decode step %s for buckets %s in %.1fs", self.backend, list(self.buckets), self.seconds)
        return self.seconds

    def prepare(self) -> None:
        """What must not change while steps run: the rotary tables at full length."""
        with torch.inference_mode():
            self._grow_rotary()

    def _grow_rotary(self) -> None:
        """The rotary tables at their full length (LongRoPE's long table too), so no compiled
        step ever grows them."""
        rope = getattr(self.model, "rope", None)
        positions = torch.zeros(1, dtype=torch.int64, device=self.device)
        for spec in getattr(self.model, "rope_specs", ()):
            past = None if spec.threshold is None else torch.full_like(positions, spec.threshold + 1)
            rope.lookup(spec, positions, self.max_pos, self.model.dtype, past)

    def _compile_all(self, held=contextlib.nullcontext, on_bucket: Callable[[], None] = lambda: None) -> None:
        import torch._dynamo

        # one graph per bucket, all entries of this decode's own code object (`own_code`); the
        # limit per code object is one setting for the process: at least this decode's buckets
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(self.buckets) + 2)
        compiled = torch.compile(self._step, backend=self._dynamo_backend, dynamic=False, fullgraph=True,
                                 options={"guard_filter_fn": skip_model_state_guards})
        if held is not contextlib.nullcontext:  # steps run beside: the compiler's own set-up outside their wait
            first_use(self._dynamo_backend)
        for b in reversed(self.buckets):
            bucket = self._buckets[b]
            width = bucket.fill((), self.scratch, self.min_width)
            batch = bucket.batch(width)
            for t in (r.block_tables for r in (batch.decode, *(g.decode for g in batch.groups))):
                torch._dynamo.mark_dynamic(t, 1, min=self.min_width, max=max(self.max_width, self.min_width + 1))
            misses = cache_misses()
            with held():
                t0 = time.perf_counter()
                compiled(batch, self.kv)
                self.held_max = max(self.held_max, time.perf_counter() - t0)
            self.cache_hits += self._dynamo_backend == "inductor" and cache_misses() == misses
            self._runs[b] = compiled
            on_bucket()

    def _capture_all(self) -> None:
        graphs = self._graphs if self._graphs is not None else CudaGraphs(self.device)
        for b in reversed(self.buckets):
            bucket = self._buckets[b]
            bucket.fill((), self.scratch, self.max_width)
            self._runs[b] = graphs.capture(lambda bucket=bucket: self._step(bucket.full, self.kv))

    # -- serving -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def done(self) -> int:
        """Buckets compiled (or captured) so far."""
        return len(self._runs)

    def fits(self, chunks) -> bool:
        """Whether these chunks are one step this decode runs: one-token sampling chunks, at
        most the largest bucket."""
        return self.ready and 0 < len(chunks) <= self.buckets[-1] and all(
            c.samples and len(c.token_ids) == 1 for c in chunks)

    def run(self, chunks) -> torch.Tensor:
        """Logits [n, V] fp32 of `n` one-token chunks (`fits`), in order."""
        b = bucket_for(len(chunks), self.buckets)
        bucket = self._buckets[b]
        if self.backend == "inductor":
            width = bucket.fill(chunks, self.scratch, self.min_width)
            with torch.inference_mode():
                return self._runs[b](bucket.batch(width), self.kv)[: len(chunks)]
        bucket.fill(chunks, self.scratch, 1)
        return self._runs[b]()[: len(chunks)].clone()  # the graph's output is overwritten by its next replay

    def describe(self) -> dict:
        return {"buckets": list(self.buckets), "seconds": round(self.seconds, 3), "state": self.state,
                "done": len(self._runs), "held_max_s": round(self.held_max, 3), "cache_hits": self.cache_hits}
