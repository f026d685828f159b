"""`--speculative` and `--num-speculative-tokens`: the names, the default and what each resolves to.

Design: one declaration both processes read (the router validates the flags, the worker's
configuration carries them). `auto` resolves per worker (workers/engine/speculate.py
`speculator_for`: suffix-tree drafts with k chosen per step where greedy output stays exact,
else off with the reason); `ngram`, `suffix` and `mtp` name the drafts' source, `mtp` the
checkpoint's own multi-token prediction head, so a checkpoint without `mtp.*` tensors is refused
by name (`mtp_error`, which reads only the safetensors headers: the router checks it before it
spawns a worker). Trade-off: a refusal at start instead of a fallback, so a deployment that asked
for a method knows it is not getting it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SPECULATIVE_MODES = ("auto", "off", "ngram", "suffix", "mtp")
SPECULATIVE_RESERVED: dict[str, str] = {}  # names the interface keeps for methods this build lacks
MTP_PREFIX = "mtp."
DEFAULT_SPECULATIVE = "auto"
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
MAX_NUM_SPECULATIVE_TOKENS = 16


def speculative_error(mode: str, num_tokens: int | None) -> str | None:
    """Why `--speculative mode` with `--num-speculative-tokens num_tokens` cannot run, or None."""
    accepted = ", ".join(SPECULATIVE_MODES)
    if mode in SPECULATIVE_RESERVED:
        return f"`--speculative {mode}` is not available: {SPECULATIVE_RESERVED[mode]}. Accepted: {accepted}"
    if mode not in SPECULATIVE_MODES:
        return f"`--speculative {mode}` is not a method. Accepted: {accepted}"
    if num_tokens is not None and not 1 <= num_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
        return (f"`--num-speculative-tokens {num_tokens}` is out of range. "
                f"Accepted: 1..{MAX_NUM_SPECULATIVE_TOKENS}")
    return None


def mtp_tensor_files(model_dir: Path | str) -> dict[str, Path]:
    """A checkpoint directory's `mtp.*` tensors and the safetensors file holding each (empty: none, or
    not a safetensors directory), from its index or the files' JSON headers (no tensor is read)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {n: model_dir / f for n, f in weight_map.items() if n.startswith(MTP_PREFIX)}
    out: dict[str, Path] = {}
    for path in sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else ():
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            out.update({n: path for n in json.loads(f.read(size)) if n.startswith(MTP_PREFIX)})
    return out


def mtp_error(mode: str, model_dir: Path | str) -> str | None:
    """Why `--speculative mode` cannot serve `model_dir` (an MTP head asked of a checkpoint without one), or None."""
    if mode != "mtp" or mtp_tensor_files(model_dir):
        return None
    accepted = ", ".join(m for m in SPECULATIVE_MODES if m != "mtp")
    return (f"`--speculative mtp` needs a checkpoint that ships an MTP head (`mtp.*` tensors); `{model_dir}` has "
            f"none. Accepted for it: {accepted}")
