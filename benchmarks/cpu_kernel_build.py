"""A CPU worker's C++ kernels built from an empty cache: one after another against side by side.

    .venv/bin/python benchmarks/cpu_kernel_build.py

Each mode runs in a child process with its own empty `TORCH_EXTENSIONS_DIR`, so both build every
kernel a bfloat16 CPU worker loads at start (`workers/engine/build.py` `build_cpu_kernels`).
Trade-off: a cold build takes a minute or more per mode on two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import sys, time
import torch
import workers.model.transformer  # noqa: F401  the model's kernels register their CppKernel instances
from kernels_local.cpp_build import CppKernel
from kernels_local.paged_attention import cpu as cpu_decode
from kernels_local.panel_linear import cpu as cpu_gemm
from workers.engine.build import build_cpu_kernels
t = time.perf_counter()
if sys.argv[1] == "parallel":
    build_cpu_kernels(torch.bfloat16, False)
else:
    for kernel in list(CppKernel.made):
        kernel.load()
    cpu_gemm.load()
    cpu_decode.load()
print(f"{time.perf_counter() - t:.1f}")
"""


def run(mode: str) -> float:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": tempfile.mkdtemp(prefix="hetserve-ext-"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    serial, parallel = run("serial"), run("parallel")
    print(f"cold C++ kernel builds: one after another {serial:.1f} s, side by side {parallel:.1f} s "
          f"({serial / parallel:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
