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
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    """The docker tests run last, their image built meanwhile (tests/docker_background.py); the
    `gpu` ones skip on a host without CUDA."""
    items.sort(key=lambda item: item.path.name == DOCKER_TESTS)  # stable: the rest keep their order
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none on this host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    """The C++ kernels (tests/cpp_background.py), the Triton interpreter runs of the collected kernel
    files (tests/interpreter.py) and the docker tests' image (tests/docker_background.py) start in
    the background: they use the core the rest of the suite leaves idle."""
    from tests.interpreter import RERUN_TEST, start_in_background

    if session.config.option.collectonly:
        return
    if len(session.items) > 50:  # a run of many files: some start real workers (tests/cpp_background.py)
        from tests.cpp_background import start_kernel_build

        start_kernel_build()
    files = sorted({str(item.path) for item in session.items if item.name == RERUN_TEST})
    if len(files) > 1:  # one file alone gains nothing from starting early
        start_in_background(files)
    docker = [item for item in session.items if "docker" in item.keywords]
    if docker and len(session.items) > len(docker) + 50:  # the image builds while the rest of the suite runs
        from tests.docker_background import start_image_build

        start_image_build()


def pytest_sessionfinish(session, exitstatus):
    from tests import cpp_background, docker_background, interpreter

    interpreter.stop_background()
    docker_background.stop_background()
    cpp_background.stop_background()
