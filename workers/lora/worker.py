"""A worker's adapters from its configuration: hooks on the model, every `--lora NAME=DIR` read.

Design: every worker that runs the whole model gets a table; the projections are hooked only
when the first adapter is read (at start with `--lora`, or at run time through `/lora/load`), so a
worker that never serves one runs exactly the model it did. Each `--lora` adapter is read and
checked at start, so a bad one fails the worker's start naming it (the `engine` step), not a
request later; beyond `--max-loras` the table keeps the last ones read and drops the others until
asked for. Trade-off: the adapters serve the worker's one model, in its dtype on its device, and
hooks installed at run time must wait for a step boundary (`Engine.steps_held`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from workers.contract.config import WorkerConfig, parse_loras
from workers.lora.adapter import read_adapter
from workers.lora.apply import install_lora
from workers.lora.metrics import LoraGauge
from workers.lora.table import LoraTable

logger = logging.getLogger(__name__)


def install_loras(engine, config: WorkerConfig, loaded, device) -> LoraTable:
    """`engine.loras`: the table of `config.lora`'s adapters (read now) over `loaded` (a
    `LoadedModel`) on `device`, its gauge beside the engine's (workers/lora/metrics.py)."""
    engine.loras = build_loras(config, loaded, device)
    engine.metrics.registry.register(LoraGauge(engine))
    return engine.loras


def build_loras(config: WorkerConfig, loaded, device) -> LoraTable:
    """The table of `config.lora`'s adapters (read now) over `loaded` (a `LoadedModel`) on `device`."""
    pairs = parse_loras(config.lora)
    model = loaded.model

    def read(name: str, path: Path):
        adapter = read_adapter(name, path, loaded.config, model, config.max_lora_rank, loaded.dtype, device)
        hooked = install_lora(model)  # once, with the first adapter
        if hooked:
            logger.info("LoRA: %s projections hooked", hooked)
        return adapter

    table = LoraTable(read, config.max_loras)
    for name, path in pairs:
        adapter = table.register(name, path)
        logger.info("LoRA adapter %s: rank %s, scale %.4g, %s projections, %s bytes (%s)", name, adapter.rank,
                    adapter.scale, len(adapter.targets), adapter.nbytes, path)
    return table
