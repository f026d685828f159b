"""The CPU image for tests/test_docker_compose.py, built in the background while the suite runs.

`scripts/docker_check.sh image` (an engine, a base image, the wheels, `docker compose build`) is
minutes of mostly single-threaded work, while the suite's end-to-end tests leave a core idle for
most of their time. So once the suite is collected (tests/conftest.py) the build starts as a
child at the lowest priority (`nice 19`, inherited by the dockerd it starts), the docker tests
are moved to the end of the run, and their fixture only collects the result. A run that never
reaches them kills the build and removes what it made. Trade-off: the build shares the disk and
the idle core with the interpreter reruns (tests/interpreter.py); both yield to the suite.
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "docker_check.sh"
BUILD_TIMEOUT_S = 2100
_started: Future | None = None
_child: list[subprocess.Popen] = []
_collected = False


def _script(*args: str, timeout: float, nice: bool = False) -> subprocess.CompletedProcess:
    cmd = ["bash", str(SCRIPT), *args]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
                          start_new_session=True, preexec_fn=(lambda: os.nice(19)) if nice else None) as child:
        _child.append(child)
        try:
            out, err = child.communicate(timeout=timeout)
        finally:
            _child.remove(child)
    return subprocess.CompletedProcess(cmd, child.returncode, out, err)


def start_image_build() -> None:
    """Start `docker_check.sh image` now, at the lowest priority."""
    global _started
    if _started is None:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="docker-image")
        _started = pool.submit(_script, "image", timeout=BUILD_TIMEOUT_S, nice=True)
        pool.shutdown(wait=False)


def image_build() -> subprocess.CompletedProcess:
    """The image build's result: the background one's (waited for), else one run now."""
    global _started, _collected
    started, _started = _started, None
    _collected = True
    if started is not None:
        return started.result(timeout=BUILD_TIMEOUT_S)
    return _script("image", timeout=BUILD_TIMEOUT_S)


def stop_background() -> None:
    """At the session's end: a build whose tests never ran stops, and what it made is removed."""
    if _started is None or _collected:
        return
    for child in list(_child):
        os.killpg(child.pid, 9)
    _started.exception(timeout=60)
    _script("clean", timeout=600)
