"""A worker's adapters from its configuration: hooks on the model, every `--lora NAME=DIR` read.

Design: a worker started without `--lora` gets no table and no hooks, so its model (and its
compiled decode step) is exactly what it was. With adapters, each one is read and checked at
start, so a bad one fails the worker's start naming it (the `engine` step), not a request later;
beyond `--max-loras` the table keeps the last ones read and drops the others until asked for.
Trade-off: the adapters serve the worker's one model, in its dtype on its device.
"""

from __future__ import annotations

import logging
from pathlib import Path

from workers.contract.config import WorkerConfig, parse_loras
from workers.lora.adapter import read_adapter
from workers.lora.apply import install_lora
from workers.lora.table import LoraTable

logger = logging.getLogger(__name__)


def build_loras(config: WorkerConfig, loaded, device) -> LoraTable | None:
    """The table of `config.lora`'s adapters over `loaded` (a `LoadedModel`) on `device`; None without any."""
    pairs = parse_loras(config.lora)
    if not pairs:
        return None
    model = loaded.model
    hooked = install_lora(model)

    def read(name: str, path: Path):
        return read_adapter(name, path, loaded.config, model, config.max_lora_rank, loaded.dtype, device)

    table = LoraTable(read, config.max_loras)
    for name, path in pairs:
        adapter = table.register(name, path)
        logger.info("LoRA adapter %s: rank %s, scale %.4g, %s projections, %s bytes (%s)", name, adapter.rank,
                    adapter.scale, len(adapter.targets), adapter.nbytes, path)
    logger.info("LoRA: %s adapters over %s hooked projections, %s slots", len(pairs), hooked, config.max_loras)
    return table
