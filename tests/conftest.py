"""Shared test configuration: the `gpu` marker skips cleanly on hosts without CUDA."""

from __future__ import annotations

import os

import pytest

# Workers started by tests run their decode step eager unless a test passes `--compile on`:
# each CPU worker compiling its buckets at start would cost the suite minutes
# (workers/contract/defaults.py ENV_COMPILE; tests of the compiled step ask for it).
os.environ.setdefault("HETSERVE_COMPILE", "off")
# What pipelines measure goes to a file of this test session, never the host's
# (~/.cache/hetserve/stage_timings.json), so no run's figures move another run's splits
# (workers/contract/stage_timing.py; tests of the timings set their own file).
if "HETSERVE_STAGE_TIMINGS" not in os.environ:
    import tempfile

    os.environ["HETSERVE_STAGE_TIMINGS"] = os.path.join(tempfile.mkdtemp(prefix="hetserve-timings-"), "timings.json")

DOCKER_TESTS = "test_docker_compose.py"  # the module whose image builds in the background
SECOND_LANE_TESTS = "test_second_lane.py"  # collects the second lane's child (tests/second_lane.py)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.hookimpl(trylast=True)  # after `-k` and `-m` chose the items
def pytest_collection_modifyitems(config, items):
    """The docker tests run last, their image built meanwhile (tests/docker_background.py); the
    `gpu` ones skip on a host without CUDA; when the suite runs whole, the second lane's files leave
    this session for its child (tests/second_lane.py)."""
    # stable: the rest keep their order; the second lane's result is collected last of all
    items.sort(key=lambda item: (item.path.name == SECOND_LANE_TESTS, item.path.name == DOCKER_TESTS))
    if not _cuda_available():
        skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none on this host)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
    from tests import second_lane

    lane = [item for item in items if second_lane.takes(item)]
    whole = any(item.path.name == SECOND_LANE_TESTS for item in items) and len(items) - len(lane) > 50
    if lane and whole and not second_lane.in_child() and not config.option.collectonly:
        config.second_lane = [item.nodeid for item in lane]
        items[:] = [item for item in items if not second_lane.takes(item)]
        config.hook.pytest_deselected(items=lane)


def pytest_collection_finish(session):
    """The C++ kernels (tests/cpp_background.py), the Triton interpreter runs of the collected kernel
    files (tests/interpreter.py), then the second lane (tests/second_lane.py), and the docker tests'
    image (tests/docker_background.py) start in the background: they use the core the rest of the
    suite leaves idle."""
    from tests import second_lane
    from tests.interpreter import RERUN_TEST, start_in_background

    if session.config.option.collectonly or second_lane.in_child():
        return
    if len(session.items) > 50:  # a run of many files: some start real workers (tests/cpp_background.py)
        from tests.cpp_background import start_kernel_build

        start_kernel_build()
    files = sorted({str(item.path) for item in session.items if item.name == RERUN_TEST})
    started = start_in_background(files) if len(files) > 1 else []  # one file alone gains nothing from it
    second_lane.start(getattr(session.config, "second_lane", []), after=started)
    docker = [item for item in session.items if "docker" in item.keywords]
    if docker and len(session.items) > len(docker) + 50:  # the image builds while the rest of the suite runs
        from tests.docker_background import start_image_build

        start_image_build()


def pytest_sessionfinish(session, exitstatus):
    from tests import cpp_background, docker_background, interpreter, second_lane

    interpreter.stop_background()
    second_lane.stop_background()
    docker_background.stop_background()
    cpp_background.stop_background()
