"""Which files make one GGUF model, and their metadata as plain Python values.

Design: `--model` may name one `.gguf` file, any part of a split model
(`name-00001-of-00003.gguf`: every part is found beside it and read in order), or a directory
holding exactly one model's files. Each file is opened with gguf-py's `GGUFReader` (a memory map:
nothing is read until a tensor is dequantized). The metadata (config and tokenizer keys) lives in
the first part; the tensors are the union of every part's. Torch-free: the router prepares a GGUF
through this module in a subprocess. Trade-off: a directory with two models is refused rather
than guessed at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """A GGUF model that cannot be read or served; the message names the file and what is wrong."""


def is_gguf(path: str | Path) -> bool:
    """A `.gguf` file, or a directory with `.gguf` files and no `config.json` (a GGUF model's directory)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.suffix == ".gguf"
    return p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf"))


def model_name(path: str | Path) -> str:
    """A GGUF model's name: its file's stem without the split suffix (a directory: its name)."""
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        return p.name
    m = SPLIT.match(p.name)
    return m.group("stem") if m else p.stem


def gguf_files(path: str | Path) -> list[Path]:
    """The files of the GGUF model at `path` (a file, a split part, or a directory), in part order."""
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        found = sorted(p.glob("*.gguf"))
        if not found:
            raise GGUFError(f"Directory `{p}` holds no `.gguf` file")
        stems = {m.group("stem") if (m := SPLIT.match(f.name)) else f.stem for f in found}
        if len(stems) > 1:
            shown = ", ".join(f"`{f.name}`" for f in found)
            raise GGUFError(f"Directory `{p}` holds more than one GGUF model ({shown}); pass one file")
        p = found[0]
    if not p.is_file():
        raise GGUFError(f"GGUF file `{p}` does not exist")
    if p.suffix != ".gguf":
        raise GGUFError(f"`{p}` is no `.gguf` file")
    m = SPLIT.match(p.name)
    if m is None:
        return [p]
    count = int(m.group("count"))
    parts = [p.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise GGUFError(f"Split GGUF `{p.name}` lacks its parts {', '.join(f'`{n}`' for n in missing)} in `{p.parent}`")
    return parts


def open_readers(files: list[Path]) -> list:
    """gguf-py readers of each file (memory maps); a file that is no GGUF is a `GGUFError` naming it."""
    from gguf import GGUFReader

    readers = []
    for f in files:
        try:
            readers.append(GGUFReader(f))
        except (ValueError, OSError) as e:
            raise GGUFError(f"`{f}` cannot be read as GGUF: {e}") from e
    return readers


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored: GGUF name, type name, shape in torch order (rows first), its file."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    file: int  # index into the model's files


def metadata(reader) -> dict[str, Any]:
    """Every key of a reader as a Python value (strings, numbers, lists), except the tensor table."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def tensor_infos(readers: list) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for i, reader in enumerate(readers):
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            out[t.name] = TensorInfo(t.name, t.tensor_type.name, shape, i)
    return out
