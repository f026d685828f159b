"""`--model FILE.gguf` (a split part, or a directory of GGUF files): the directory the router serves it from.

Design: the router reads a model as a Hugging Face directory (config checks, chat template,
tokenizer) and hands workers a directory, so a GGUF is first prepared as one: its config and
tokenizer converted once and cached by its header, pointing at the GGUF files for the weights
(workers/gguf/prepare.py). The router never imports the workers, so it runs that step as a
subprocess, `python -m workers.gguf PATH`, as `hetserve plan --model` describes a model. Trade-off:
a second of start-up per GGUF model for a router that stays torch-free.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from server.errors import UsageError, shown

PREPARE_TIMEOUT_S = 300.0  # reading a large vocabulary and writing its tokenizer.json


def is_gguf_path(path: Path) -> bool:
    """A `.gguf` file, or a directory with `.gguf` files and no config.json."""
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf"))


def prepare_gguf(path: Path) -> tuple[Path, str]:
    """(the prepared directory, the model's name) of the GGUF model at `path`; a `UsageError` naming the
    file and what is wrong (an architecture, tokenizer or file we cannot serve)."""
    cmd = [sys.executable, "-m", "workers.gguf", str(path)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PREPARE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise UsageError(f"`--model {shown(str(path))}`: reading the GGUF took over {PREPARE_TIMEOUT_S:.0f} s") from e
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise UsageError(f"`--model {shown(str(path))}`: {lines[-1] if lines else f'exit {done.returncode}'}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return Path(out["dir"]), out["name"]
