"""A worker's adapters from its configuration: hooks on the model, every `--lora NAME=DIR` read.

Design: every worker that runs the whole model gets a table; the projections are hooked (and the
model's `LoraPool` of `--max-loras` slots made, each projection's memory taken on first use) only
when the first adapter is read (at start with `--lora`, or at run time through `/lora/load`), so a
worker that never serves one runs exactly the model it did. Each `--lora` adapter is read and
checked at start, so a bad one fails the worker's start naming it (the `engine` step), not a
request later; beyond `--max-loras` the table keeps the last ones read and drops the others until
asked for. With the first adapter the model's `LoraDelta` runs the kernel its device chose; that
kernel is checked once against its torch path on a small mixed batch of that adapter in its slot (a
kernel that fails or disagrees is replaced by the torch path, with the reason in the log), as the
worker's self-test checks the model's other kernels at start. Trade-off: the adapters serve the
worker's one model on its device, in its dtype (float32 on a CPU: `adapter_dtype`), and hooks
installed at run time wait for a step boundary (`Engine.steps_held`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from workers.contract.config import CPU_LORAS_PER_SLOT, WorkerConfig, parse_loras
from workers.kernelize.selftest import to_torch_path
from workers.lora.adapter import LoraAdapter, read_adapter
from workers.lora.apply import LoraBatch, LoraDelta, install_lora
from workers.lora.metrics import LoraGauge
from workers.lora.pool import LoraPool
from workers.lora.table import LoraTable

logger = logging.getLogger(__name__)


def install_loras(engine, config: WorkerConfig, loaded, device) -> LoraTable:
    """`engine.loras`: the table of `config.lora`'s adapters (read now) over `loaded` (a
    `LoadedModel`) on `device`, its gauge beside the engine's (workers/lora/metrics.py)."""
    engine.loras = build_loras(config, loaded, device)
    engine.metrics.registry.register(LoraGauge(engine))
    return engine.loras


def build_loras(config: WorkerConfig, loaded, device) -> LoraTable:
    """The table of `config.lora`'s adapters (read now) over `loaded` (a `LoadedModel`) on `device`:
    host copies read onto the CPU (pinned for a CUDA device), slots in the model's `LoraPool`."""
    pairs = parse_loras(config.lora)
    model = loaded.model
    pin = torch.device(device).type == "cuda"
    dtype, why = adapter_dtype(loaded.dtype, device)
    logger.info("LoRA adapters in %s: %s", str(dtype).removeprefix("torch."), why)

    def read(name: str, path: Path) -> LoraAdapter:
        adapter = read_adapter(name, path, loaded.config, model, config.max_lora_rank, dtype, "cpu")
        if pin:
            adapter = pinned(adapter)
        hooked = install_lora(model)  # once, with the first adapter
        if hooked:
            logger.info("LoRA: %s projections hooked", hooked)
            model.lora_state.delta.pool = LoraPool(model, loaded.config, config.max_loras, config.max_lora_rank,
                                                   dtype, device)
        return adapter

    def place(adapter: LoraAdapter, slot: int) -> LoraAdapter:
        delta = model.lora_state.delta
        placed = delta.pool.write(slot, adapter)
        if not checked:  # the chosen kernel against its torch path, once, on the first adapter placed
            checked.append(True)
            why = check_delta(delta, placed, device)
            if why is not None:
                to_torch_path(delta, "LoraDelta")
                logger.warning("LoRA kernel replaced by its torch path: %s", why)
        return placed

    checked: list[bool] = []
    host = config.max_cpu_loras or CPU_LORAS_PER_SLOT * config.max_loras
    table = LoraTable(read, config.max_loras, place, host)
    for name, path in pairs:
        adapter = table.register(name, path)
        logger.info("LoRA adapter %s: rank %s, scale %.4g, %s projections, %s bytes (%s)", name, adapter.rank,
                    adapter.scale, len(adapter.targets), adapter.nbytes, path)
    return table


def adapter_dtype(model_dtype: torch.dtype, device) -> tuple[torch.dtype, str]:
    """The dtype a worker keeps its adapters' weights in on `device`, with the reason: float32 on a CPU,
    whose bfloat16 and float16 matmuls of the adapters' thin shapes (a rank of 8-64 against the hidden
    size) take a slow path there, and whose float32 ones are MKL's; the model's dtype elsewhere, the
    segmented kernel's. The delta is added to the projection's output in the model's dtype either way."""
    if torch.device(device).type == "cpu" and model_dtype != torch.float32:
        return torch.float32, (f"a CPU multiplies the adapters' thin matrices in float32 far faster than in "
                               f"{str(model_dtype).removeprefix('torch.')}; the delta is added in the model's dtype")
    return model_dtype, "the model's dtype, which the LoRA kernel reads"


def pinned(adapter: LoraAdapter) -> LoraAdapter:
    """`adapter` with its host tensors in page-locked memory (copies into a slot run asynchronously)."""
    targets = {name: tuple(replace(t, a=t.a.pin_memory(), b=t.b.pin_memory()) for t in pairs)
               for name, pairs in adapter.targets.items()}
    return replace(adapter, targets=targets)


def check_delta(delta: LoraDelta, adapter: LoraAdapter, device) -> str | None:
    """Why `delta`'s chosen forward is not its torch path's on a small batch of `adapter` (two of its
    rows around a base row, its first projection); None when it agrees, or is the torch path."""
    if "forward" not in delta.__dict__ or not adapter.targets:
        return None  # not kernelized (the torch path itself), or nothing for the kernel (experts only)
    name, pairs = next(iter(adapter.targets.items()))
    dtype = pairs[0].a.dtype
    gen = torch.Generator().manual_seed(0)
    width = max(t.offset + t.size for t in pairs)
    if delta.pool is not None and adapter.slot is not None:
        width = delta.pool.stack(name).b.shape[1]  # the kernel writes the pool's parts: the whole output
    x = torch.randn(3, pairs[0].a.shape[1], generator=gen).to(device, dtype)
    out = torch.randn(3, width, generator=gen).to(device, dtype)
    batch = LoraBatch.from_rows([adapter, None, adapter], device)
    want, got = out.clone(), out.clone()
    delta.torch_delta(name, x, want, batch)
    try:
        delta.forward(name, x, got, batch)
    except Exception as e:  # a kernel that cannot run here: the torch path serves instead
        return f"{type(e).__name__}: {e}"
    err = float((got.float() - want.float()).abs().max())
    scale = max(1.0, float(want.float().abs().max()))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    return None if err <= tol * scale else f"differs from the torch path by {err:.3g} (tolerance {tol * scale:.3g})"
