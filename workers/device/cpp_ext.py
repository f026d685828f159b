"""The worker's own C++ on a CPU host: built once per host with torch's extension builder.

Design: `build(stem, source, flags)` compiles `source` into torch's extension cache
(`$TORCH_EXTENSIONS_DIR`) under `stem` and a hash of the source and flags, so an edited source or
other flags build anew and a later start only loads (well under a second); the first build takes
20-40 s on 2 cores. It never raises: a host without a C++ compiler, or a failed build, gives the
reason, and the caller keeps its torch path (workers/kv/cpu_decode.py, workers/model/cpu_gemm.py).
Trade-off: a compiler at first use, which Inductor needs anyway to compile a CPU step.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def build(stem: str, source: Path, flags: list[str]):
    """(module, None) once `source` is built and imported, or (None, why not)."""
    try:
        from torch.utils import cpp_extension

        digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
        return cpp_extension.load(f"{stem}_{digest}", [str(source)], extra_cflags=flags, verbose=False), None
    except Exception as e:  # no compiler, a failed build
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}"
