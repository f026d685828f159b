"""`GET /capability`: what a ready worker says about itself, as one pydantic model.

The worker builds a `CapabilityPayload` and serves `model_dump(mode="json")`; the router
parses the answer with `CapabilityPayload.model_validate` and reads typed fields, never
`dict.get` chains. This is the HTTP edge between the two processes, hence pydantic here
while the values inside each process are frozen dataclasses. Nested objects allow extra
fields, so a newer worker can report more (say, compile records of its kernels) without
breaking an older router; every field has a default so that a partial answer (a worker
stand-in, an older worker) still parses, and what is missing reads as unknown.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class DeviceDescription(_Open):
    """`/workers` `device`: the same seven fields the router knows from its inventory."""

    type: str | None = None
    index: int | None = None
    uuid: str | None = None
    name: str | None = None
    capability: str | None = None  # "9.0"; None for a CPU
    simulated: bool | None = None
    memory_total_bytes: int | None = None


class Fp8Description(_Open):
    convention: str | None = None  # "native_e4m3" | "emulated": the device's convention, used or not
    reason: str | None = None
    used: bool | None = None  # any layer computes from fp8 bytes (--quantize fp8, an fp8 checkpoint)
    label: str | None = None  # the convention when used, else "not used (bfloat16)": what headers show


class KernelDescription(_Open):
    """One layer's chosen kernel (`kernels_local.mapping.KernelChoice`) and, when the worker
    ran the preflight, its compile record (`compiled{target, shared_bytes, instruction, ok}`)."""

    repo: str
    layer: str
    variant: str
    reason: str
    compiled: dict | None = None


class ModelDescription(_Open):
    id: str | None = None
    dtype: str | None = None
    context_length: int | None = None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    # generation_config.json sampling values (temperature, top_p, top_k, repetition_penalty)
    sampling_defaults: dict[str, int | float] = Field(default_factory=dict)  # top_k 40 stays 40, not 40.0
    architecture: str | None = None  # the family (workers/model/families/registry.py)
    # what it switches on beyond Llama: rope type, sliding_window, attn_softcap, qk_norm, ...
    features: dict = Field(default_factory=dict)
    # head_dim, scale, softcap, layer_types [{type: full | sliding, layers, window}] (workers/model/describe.py)
    attention: dict | None = None


class DeterministicDescription(_Open):
    """`/workers` `deterministic`: whether the worker runs batch-invariant numerics
    (`--deterministic`, workers/model/deterministic.py) and with which fixed shapes."""

    enabled: bool = False
    row_tile: int | None = None  # rows per projection GEMM
    kv_split: int | None = None  # cached positions per attention split (torch path)
    attention: str | None = None  # how every row attends (fixed splits over the paged cache)


class CompileDescription(_Open):
    """`/capability` `compile`: whether the worker runs its decode step compiled (`--compile`,
    workers/engine/compiled.py), how, for which batch sizes, and why."""

    mode: str | None = None  # what was asked: auto | on | off
    enabled: bool = False
    backend: str | None = None  # "inductor" (CPU) | "cuda-graphs" (CUDA and ROCm)
    reason: str | None = None
    buckets: list[int] = Field(default_factory=list)  # batch sizes a decode step is padded to
    seconds: float | None = None  # compile (or capture) time at start
    # "ready" (in use), "compiling" (in the background: steps run eager meanwhile), "failed"
    # (eager from then on; `reason` says why); None: not compiled
    state: str | None = None
    done: int | None = None  # buckets compiled so far
    held_max_s: float | None = None  # the longest the engine's steps waited on the compile of one bucket
    cache_hits: int | None = None  # buckets found compiled in the on-disk caches (a child process filled them)


class Load(BaseModel):
    running: int = 0
    queued: int = 0


class EngineLiveness(_Open):
    """`/health` `engine`: whether the engine makes progress (workers/engine/liveness.py)."""

    pending: bool = False  # requests accepted and not finished
    last_step_age_s: float = 0.0  # since the last completed step, or since work arrived if later
    steps: int = 0


class HealthPayload(_Open):
    """A worker's `GET /health` (200 when ready, 503 otherwise). `engine` is None from a worker
    that does not report liveness (an older worker, a stand-in)."""

    status: str | None = None  # "ready" | "starting" | "draining"
    worker_id: str | None = None
    load: Load = Field(default_factory=Load)
    engine: EngineLiveness | None = None
    capacity: dict | None = None  # the KV cache's changing figures (`kv_blocks_free`)
    compile: CompileDescription | None = None  # the decode step's compilation, which goes on after ready
    # LoRA adapters: {max_loras, running, waiting, pool, adapters: [{name, path, loaded, slot, on_host, requests}]};
    # None: no table (workers/lora/metrics.py `describe_loras`)
    loras: dict | None = None
    speculative: dict | None = None  # speculative decoding now: method, k, acceptance, reason (None: not said)
    preparing: list[str] | None = None  # what still builds or compiles behind the serving, in words
    fallbacks: dict[str, str] | None = None  # each kernel on its torch path on this device -> why


class CapabilityPayload(_Open):
    worker_id: str | None = None
    pid: int | None = None
    device: DeviceDescription = Field(default_factory=DeviceDescription)
    fp8: Fp8Description = Field(default_factory=Fp8Description)
    kernels: dict[str, KernelDescription] = Field(default_factory=dict)
    # max_sequences, max_tokens, max_seq_len, kv_cache_bytes, kv_block_size, kv_blocks_total,
    # kv_blocks_free (at the time of the answer), prefix_cache ("on" / "off"), kv_groups
    # [{window (None: full attention), layers, blocks}]
    capacity: dict = Field(default_factory=dict)
    model: ModelDescription = Field(default_factory=ModelDescription)
    versions: dict[str, str | None] = Field(default_factory=dict)
    load: Load = Field(default_factory=Load)
    triton_cache: str | None = None  # this architecture's Triton cache directory
    deterministic: DeterministicDescription | None = None  # set (and shown) only with --deterministic
    compile: CompileDescription | None = None  # the decode step's compilation (None: a worker that does not say)
    # what still builds or compiles behind the serving, one line each ("decode step: eager, compiling 4
    # of 6 buckets"); None (absent) once everything is in use
    preparing: list[str] | None = None
    # each layer (a C++ kernel, the decode step) whose kernel failed on this device -> why its torch path
    # serves instead (self-test, build, compile or capture); None (absent): none
    fallbacks: dict[str, str] | None = None
    # speculative decoding: method, k, acceptance rate and the latest decision's reason (workers/engine/speculate.py)
    speculative: dict | None = None
    pipeline: dict | None = None  # a pipeline's first stage: {stages: [each stage's layers, device, kernels, fp8]}
