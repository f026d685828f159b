"""Running a kernel test file under `TRITON_INTERPRET=1`, once, whatever mode this process is in.

Triton decides at decoration time whether a `@triton.jit` function is compiled or
interpreted, and that includes its own standard library (`tl.sum`, `tl.sigmoid`), created
when `triton.language` is first imported. So the variable must be set before triton is
imported at all. When this process already imported triton in compiled mode (the whole
suite in one process), a file's `rerun_under_interpreter` test runs the file again in a
child pytest with `TRITON_INTERPRET=1` and its kernel tests (`needs_interpreter`) skip; in
the child (or when the suite itself runs with the variable set) they run. Either way once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = type(tl.sum).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child (test_kernels_run_under_the_interpreter)"
)


def rerun_under_interpreter(file: str, timeout: float = 540) -> None:
    """Run the test file `file` in a child pytest with `TRITON_INTERPRET=1`; assert it passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", file, "-q", "-p", "no:cacheprovider", "-x"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]
