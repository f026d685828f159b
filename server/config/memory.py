"""How long a sequence may be and how much of each device its worker may take: `--max-model-len`
and `--gpu-memory-utilization` (as vLLM's flags; docs/serving.md).

Design: `--max-model-len` is checked here against each offered checkpoint's own context length
(`workers/contract/model_size.py`), so a value larger than a model was trained for is one named
error before any worker starts, not a worker that fails at load. `--gpu-memory-utilization` is a
fraction of each device's *own* memory (workers/kv/sizing.py `kv_budget`), so an 80 GB card and a
16 GB card of one host each get their share. Trade-off: one fraction for every device, not a
budget per device; `--kv-cache-bytes` caps it where a user wants bytes."""

from __future__ import annotations

import argparse

from server.config.models import ModelsConfig
from server.errors import UsageError, shown
from workers.contract.model_size import ModelSizeError, read_profile


def add_memory_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="longest sequence (prompt plus output) a worker serves; at most the checkpoint's context "
                        "length (default: the checkpoint's context length)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="fraction of each device's own memory (0 < F <= 1) its worker may use for weights and KV "
                        "cache; the KV budget is what is left of it after loading (default: 85%% of the free "
                        "memory after loading on a GPU; the CPU default on CPU and simulated devices); placement "
                        "offers each model this share of each device (default 0.9)")


def max_model_len_from_args(args, models: ModelsConfig) -> int | None:
    """`--max-model-len`, checked against every offered checkpoint's context length."""
    value = getattr(args, "max_model_len", None)
    if value is None:
        return None
    if value < 1:
        raise UsageError(f"`--max-model-len {value}` must be at least 1 token")
    for entry in models.catalog():
        try:
            context = read_profile(entry.path).context_length
        except ModelSizeError:
            continue  # an unreadable checkpoint is refused by its own check, with its reason
        if value > context:
            raise UsageError(f"`--max-model-len {value}` is longer than model `{entry.name}`'s context length "
                             f"{context} (`max_position_embeddings` in {shown(str(entry.path))}/config.json). "
                             f"Accepted: 1-{context}")
    return value


def gpu_memory_utilization_from_args(args) -> float | None:
    """`--gpu-memory-utilization`, a fraction in (0, 1]."""
    value = getattr(args, "gpu_memory_utilization", None)
    if value is None:
        return None
    if not 0.0 < value <= 1.0:
        raise UsageError(f"`--gpu-memory-utilization {value}` is not a fraction of the device's memory. "
                         "Accepted: 0 < F <= 1 (e.g. 0.9)")
    return float(value)
