"""How a worker runs a GGUF file's tensors, and why (`/capability` `model.gguf`, `/workers`).

Design: the per-device rule of the format, one answer with its reason, as for the other
quantized formats. Today the rule has one branch on every device: the blocks are dequantized at
load to the model's dtype (workers/gguf/weights.py, exact against gguf-py's `dequantize`), since no
packed GGUF kernel is built for any device yet. The description counts the file's tensors by type
and gives their packed bytes beside the bytes the worker holds, so a user sees what packed
execution would save on each card. Trade-off: reading the tensor table costs a header parse per
start (memory-mapped, no tensor data read), for a description that never goes stale.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from workers.gguf.files import open_readers
from workers.gguf.prepare import pointed_files


def gguf_execution(model_dir: Path, dtype: torch.dtype, device_type: str) -> dict | None:
    """What a worker on `device_type` holding the model in `dtype` does with the GGUF file(s)
    `model_dir` stands for; None when `model_dir` is no prepared GGUF directory."""
    files = pointed_files(model_dir)
    if files is None:
        return None
    tensors = [t for reader in open_readers(files) for t in reader.tensors]
    types = Counter(t.tensor_type.name for t in tensors)
    packed = sum(int(t.n_bytes) for t in tensors)
    resident = sum(int(t.n_elements) for t in tensors) * torch.empty((), dtype=dtype).element_size()
    name = str(dtype).removeprefix("torch.")
    return {"types": dict(sorted(types.items())), "execution": f"dequantized at load to {name}",
            "reason": f"no packed GGUF kernel on {device_type} yet: each block is dequantized once at load, exactly "
                      f"as gguf-py does, and the layers run in {name}",
            "packed_bytes": packed, "resident_bytes": resident}
