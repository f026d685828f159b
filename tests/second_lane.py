"""A second lane for the whole suite: a few CPU-bound files run in a child pytest beside the rest.

When the whole suite runs in one process, its second half is mostly waiting: end-to-end tests wait on
the servers they started while a core idles. A few files are the opposite, minutes of computing in
the test process itself, with no clock to race (Inductor compiling, checkpoints compared with
transformers, Triton compiling for the preflight). When the suite runs whole (tests/conftest.py),
their collected tests leave the main session and run in one child pytest of their own, started once
the Triton interpreter runs (tests/interpreter.py) are done, at a lower priority than the suite's
own processes; `test_second_lane.py` collects its result at the end of the run. Trade-off: one
line in the main session's report for those files (the child's own report on failure), and their
tests run beside the others rather than alone, which a file with a clock to race could not take:
`FILES` holds none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import Future, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("test_compiled_step.py", "test_gguf_load.py", "test_compile_child.py", "test_preflight.py",
         "test_families.py", "test_plan.py", "test_models_config.py", "test_preflight_skip.py",
         "test_fp8_checkpoint_load.py", "test_compiled_guards.py", "test_lora_compiled.py", "test_deterministic.py",
         "test_linear_attention.py", "test_fp8_experts_load.py")  # fmt: skip
ENV_CHILD = "HETSERVE_TESTS_SECOND_LANE"  # set in the child: it runs its files, starts no background work
NICE = 5  # below the suite's own processes, above the interpreter runs (19)
TIMEOUT_S = 3000
_result: Future | None = None
_child: list[subprocess.Popen] = []
_stopping = False


def in_child() -> bool:
    return os.environ.get(ENV_CHILD) == "1"


def takes(item) -> bool:
    """Whether the collected `item` belongs to the second lane."""
    return item.path.name in FILES


def start(nodeids: list[str], after: list[Future]) -> None:
    """Run `nodeids` in the child once every future of `after` (the interpreter runs) is done."""
    global _result
    if _result is not None or not nodeids:
        return
    _result = Future()

    def run() -> None:
        wait(after)
        try:
            _result.set_result(_run(nodeids))
        except BaseException as e:  # noqa: BLE001 - the collecting test reports it
            _result.set_exception(e)

    threading.Thread(target=run, name="second-lane", daemon=True).start()


def _run(nodeids: list[str]) -> subprocess.CompletedProcess:
    if _stopping:
        raise RuntimeError("the test session ended before the second lane started")
    env = {**os.environ, ENV_CHILD: "1"}
    env.pop("HETSERVE_STAGE_TIMINGS", None)  # the child's conftest makes its own file (tests/conftest.py)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids]
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: os.nice(NICE)) as child:  # fmt: skip
        _child.append(child)
        if _stopping:
            child.kill()
        out, err = child.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(cmd, child.returncode, out, err)


def started() -> bool:
    return _result is not None


def result(timeout: float) -> subprocess.CompletedProcess:
    assert _result is not None, "the second lane was not started"
    return _result.result(timeout=timeout)


def stop_background() -> None:
    """At the session's end: a child still running (its collecting test deselected) stops."""
    global _stopping
    _stopping = True
    for child in list(_child):
        if child.poll() is None:
            child.kill()
