"""A C++ kernel build killed at any instant never wedges a later start (kernels_local/cpp_build.py
`build`): torch's extension lock file left by a killed builder is cleared under the builders' own
`flock`, and the next build serves. Each case builds a one-operator extension in a fresh
`TORCH_EXTENSIONS_DIR`, in child processes, as a worker would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)

SOURCE = textwrap.dedent("""
    #include <ATen/core/Tensor.h>
    #include <ATen/ops/add.h>
    #include <torch/library.h>

    at::Tensor twice(const at::Tensor& x) { return at::add(x, x); }

    TORCH_LIBRARY_FRAGMENT(hetserve_build_test, m) { m.def("twice(Tensor x) -> Tensor", &twice); }
""")

CHILD = textwrap.dedent("""
    import sys, logging
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import torch
    from kernels_local.cpp_build import build

    ops, why = build("hetserve_build_test", Path(sys.argv[1]), ["-O0"], ops="hetserve_build_test")
    assert ops is not None, why
    print(ops.twice(torch.ones(2)).tolist())
""")


def _child(source: Path, ext_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(source)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def _build_dir(ext_dir: Path) -> Path | None:
    found = [d for d in ext_dir.rglob("hetserve_build_test_*") if d.is_dir()]
    return found[0] if found else None


def _serves(source: Path, ext_dir: Path) -> str:
    child = _child(source, ext_dir)
    try:
        out, err = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        pytest.fail("the build after a killed one waited past 300 s: a stale lock wedged it")
    assert child.returncode == 0 and out.strip() == "[2.0, 2.0]", err[-3000:]
    return err


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "twice.cpp"
    path.write_text(SOURCE)
    return path


def test_a_lock_left_by_a_killed_build_is_cleared_and_the_next_build_serves(source, tmp_path):
    """Guards `_clear_stale` in `build`: without it, torch's FileBaton waits forever on the 0-byte
    `lock` a killed builder left beside the build."""
    ext_dir = tmp_path / "ext"
    first = _serves(source, ext_dir)  # a finished build, as the host had
    assert "built C++ kernel hetserve_build_test_" in first
    lock = _build_dir(ext_dir) / "lock"
    lock.write_text("")  # what a builder killed while holding torch's baton leaves
    err = _serves(source, ext_dir)
    assert f"clearing {lock}, left by a build that was killed" in err
    assert not lock.exists()


@pytest.mark.parametrize("kill_when", ["lock", "ninja"])
def test_a_build_killed_half_way_leaves_a_host_that_builds_and_serves(source, tmp_path, kill_when):
    """A builder killed once torch's lock exists (`lock`) or once its compiler runs (`ninja`): the
    next start builds and serves."""
    ext_dir = tmp_path / "ext"
    child = _child(source, ext_dir)
    deadline = time.monotonic() + 120
    marker = "lock" if kill_when == "lock" else "build.ninja"
    while time.monotonic() < deadline and child.poll() is None:
        d = _build_dir(ext_dir)
        if d is not None and (d / marker).exists():
            break
        time.sleep(0.02)
    assert child.poll() is None, "the build finished before it could be killed"
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    _serves(source, ext_dir)


DEFERRING_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    from kernels_local.cpp_build import DEFERRED, build, build_deferred, deferring

    source = Path(sys.argv[1])
    args = ("hetserve_build_test", source, ["-O0"], "hetserve_build_test")
    with deferring() as pending:
        ops, why = build(*args)
    assert ops is None and why == DEFERRED and len(pending) == 1, (ops, why, pending)
    assert not list(Path(sys.argv[2]).rglob("*.so")), "a deferred build ran"
    assert set(build_deferred(pending, 1).values()) == {None}
    with deferring() as pending:  # built now: it loads even while deferring
        ops, why = build(*args)
    assert why is None and not pending, (why, pending)
    print(ops.twice(torch.ones(2)).tolist())
""")


def test_a_deferred_build_answers_at_once_and_builds_when_asked(source, tmp_path):
    """Guards the `_deferred` branch of `build` (kernels_local/cpp_build.py): a worker serving first
    gets its torch path at once for a kernel not built on the host, and `build_deferred` builds it."""
    ext_dir = tmp_path / "ext"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", DEFERRING_CHILD, str(source), str(ext_dir)], cwd=ROOT, env=env,
                       text=True, capture_output=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[2.0, 2.0]", r.stderr[-3000:]
