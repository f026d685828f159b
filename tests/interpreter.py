"""Running a kernel test file under `TRITON_INTERPRET=1`, once, whatever mode this process is in.

Triton decides at decoration time whether a `@triton.jit` function is compiled or
interpreted, and that includes its own standard library (`tl.sum`, `tl.sigmoid`), created
when `triton.language` is first imported. So the variable must be set before triton is
imported at all. When this process already imported triton in compiled mode (the whole
suite in one process), a file's `rerun_under_interpreter` test runs the file again in a
child pytest with `TRITON_INTERPRET=1` and its kernel tests (`needs_interpreter`) skip; in
the child (or when the suite itself runs with the variable set) they run. Either way once.

The children are CPU-bound for minutes in all while the suite's end-to-end tests mostly wait on
their servers, so once the suite is collected (tests/conftest.py) they start one after another
in the background at the lowest priority (`nice 19`): they take the core the suite leaves idle
and yield it to the suite's own processes, and `rerun_under_interpreter` then only collects the
result, waiting at most its timeout from that moment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = type(tl.sum).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child (test_kernels_run_under_the_interpreter)"
)


RERUN_TEST = "test_kernels_run_under_the_interpreter"  # the test of each such file that runs it
_BACKGROUND_TIMEOUT_S = 3600  # a starved background child's own bound; the waiting test has its own
_started: dict[str, Future] = {}
_running: list[subprocess.Popen] = []  # the background child now running, if any
_stopping = False


def _run(file: str, timeout: float, nice: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", file, "-q", "-p", "no:cacheprovider", "-x"]
    if not nice:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if _stopping:
        raise RuntimeError("the test session ended before this interpreter run started")
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: os.nice(19)) as child:
        _running.append(child)
        if _stopping:  # the session ended while this child started
            child.kill()
        try:
            out, err = child.communicate(timeout=timeout)
        finally:
            _running.remove(child)
    return subprocess.CompletedProcess(cmd, child.returncode, out, err)


def start_in_background(files) -> list[Future]:
    """Start the interpreter runs of `files` now, one at a time, at the lowest priority; their futures."""
    if INTERPRETED:
        return []
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="triton-interpreter")
    for file in files:
        _started[str(Path(file).resolve())] = pool.submit(_run, str(file), _BACKGROUND_TIMEOUT_S, True)
    pool.shutdown(wait=False)
    return list(_started.values())


def stop_background() -> None:
    """At the session's end: runs not collected (their tests deselected or never reached) stop."""
    global _stopping
    _stopping = True
    for started in _started.values():
        started.cancel()
    for child in list(_running):
        child.kill()


def rerun_under_interpreter(file: str, timeout: float = 540) -> None:
    """Run the test file `file` in a child pytest with `TRITON_INTERPRET=1` (or collect the run
    started in the background); assert it passed."""
    started = _started.pop(str(Path(file).resolve()), None)
    proc = started.result(timeout=timeout) if started is not None else _run(file, timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]
