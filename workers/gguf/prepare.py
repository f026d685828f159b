"""A GGUF model as a model directory: its config and tokenizer converted once, cached by its header.

Design: everything that reads a checkpoint (the router's checks and chat templates, the worker's
loader, `hetserve plan`) reads a Hugging Face directory, so `prepare(path)` makes one for a GGUF:
`config.json`, `tokenizer.json`, `tokenizer_config.json` (with `tokenizer.chat_template`),
`generation_config.json`, and `gguf.json`, which lists the GGUF files whose tensors the loader
reads in place of safetensors (workers/gguf/weights.py). The rule: the directory lives under
`~/.cache/hetserve/gguf/<key>/` (`$XDG_CACHE_HOME` where set), `key` the SHA-256 of each file's
resolved path, size and header (its metadata and tensor table: everything the conversion reads),
so it is written the first time a file is opened and reused after; a changed or moved file gets a
new one. It is written into a temporary directory and renamed, so two processes preparing the
same file never see half of it.
Torch-free: the router runs `python -m workers.gguf PATH` (prints the directory) before any
worker starts. Trade-off: the weights are never copied; the cache holds only the small files.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from workers.contract.gguf_rule import CPU_PACKED_TYPES, PACKED_TENSOR, PACKED_TYPES
from workers.gguf.config import hf_config
from workers.gguf.files import gguf_files, metadata, model_name, open_readers, tensor_infos
from workers.gguf.tokenizer import build_tokenizer, tokenizer_config

POINTER = "gguf.json"  # the GGUF files a prepared directory stands for
FORMAT = 7  # bump when the converted files change, so old cache entries are not reused


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/hetserve/gguf` (`~/.cache/hetserve/gguf` where unset), as other user caches live."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "hetserve" / "gguf"


def cache_key(files: list[Path], readers: list) -> str:
    h = hashlib.sha256(f"hetserve-gguf-{FORMAT}".encode())
    for f, r in zip(files, readers, strict=True):
        h.update(f"{f}\0{f.stat().st_size}\0".encode())
        h.update(bytes(r.data[: r.data_offset]))  # the header: metadata and tensor table
    return h.hexdigest()[:32]


def _write(target: Path, files: list[Path], readers: list) -> None:
    meta = metadata(readers[0])
    tensors = tensor_infos(readers)
    freqs = [t for r in readers for t in r.tensors if t.name == "rope_freqs.weight"]
    config = hf_config(meta, tensors, np.array(freqs[0].data, dtype=np.float32) if freqs else None)
    tokenizer = build_tokenizer(meta)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta), indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    pointer = {"files": [str(f) for f in files], "name": model_name(files[0]),
               "architecture": meta.get("general.architecture"), "sizes": sizes(readers)}
    (tmp / POINTER).write_text(json.dumps(pointer, indent=2))
    try:
        os.rename(tmp, target)
    except OSError:  # another process prepared it first: theirs is the same
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def sizes(readers: list) -> dict:
    """The tensors' elements and bytes, those a packed device holds as blocks (`packable`) apart, and
    the embedding a CPU's packed tied head keeps as blocks (`cpu_tied`, workers/gguf/embedding.py):
    what the router's placement counts per device (workers/contract/model_size.py)."""
    out = {"elements": 0, "bytes": 0, "packable_elements": 0, "packable_bytes": 0, "cpu_packable_elements": 0,
           "cpu_packable_bytes": 0, "cpu_tied_elements": 0, "cpu_tied_bytes": 0}
    tied = all(t.name != "output.weight" for r in readers for t in r.tensors)  # the head reads the embedding
    for reader in readers:
        for t in reader.tensors:
            n, b = int(t.n_elements), int(t.n_bytes)
            out["elements"] += n
            out["bytes"] += b
            if t.tensor_type.name in PACKED_TYPES and PACKED_TENSOR.match(t.name):
                out["packable_elements"] += n
                out["packable_bytes"] += b
                if t.tensor_type.name in CPU_PACKED_TYPES:  # the CPU's packed part of them
                    out["cpu_packable_elements"] += n
                    out["cpu_packable_bytes"] += b
            elif tied and t.name == "token_embd.weight" and t.tensor_type.name in CPU_PACKED_TYPES:
                out["cpu_tied_elements"], out["cpu_tied_bytes"] = n, b  # the CPU's packed head shares them
    return out


def prepare(path: str | Path, root: str | Path | None = None) -> Path:
    """The model directory standing for the GGUF model at `path` (a file, a split part or a directory)."""
    files = gguf_files(path)
    readers = open_readers(files)
    root = Path(root).expanduser() if root is not None else cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / cache_key(files, readers)
    if not (target / POINTER).is_file():
        _write(target, files, readers)
    return target


def pointed_files(model_dir: Path) -> list[Path] | None:
    """The GGUF files a prepared directory stands for; None for any other directory."""
    pointer = Path(model_dir) / POINTER
    if not pointer.is_file():
        return None
    return [Path(f) for f in json.loads(pointer.read_text())["files"]]
