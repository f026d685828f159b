"""The layers between the processes and inside each, enforced by import-linter (contracts in
pyproject.toml).

Between the processes: the router imports from `workers` only the torch-free contract, the
contract stays torch-free, workers never import the router, kernel repositories import
neither, and nothing in the router imports torch (`tests/test_router_no_cuda.py` checks that
one at run time too). Inside each: the worker's packages follow its mission (contract <-
device <- kv | quant <- model <- kernelize <- sampling <- engine <- serving <- main) and the
router's run from the commands down to the configuration; no import runs back up a layer.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--config", str(cwd / "pyproject.toml"), "--no-cache"], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize(
    "module,line,contract",
    [
        ("server/routing/filter.py", "import workers.engine.core", "only the torch-free contract"),
        ("server/routing/filter.py", "import torch", "never imports torch"),
        ("workers/contract/defaults.py", "import torch", "stays light"),
        ("workers/sampling/params.py", "import server.edge.app", "never import the router"),
        ("kernels_local/rmsnorm/layers.py", "import workers.quant.fp8_convention",
         "Kernel repositories import neither"),
        # inside the worker: a lower step importing a higher one
        ("workers/model/transformer.py", "import workers.engine.scheduler", "worker's packages keep their layers"),
        ("workers/kv/pool.py", "import workers.model.config", "worker's packages keep their layers"),
        ("workers/device/bind.py", "import workers.kernelize.apply", "worker's packages keep their layers"),
        ("workers/quant/fp8_convention.py", "import workers.model.config", "worker's packages keep their layers"),
        # inside the router
        ("server/protocol/chat.py", "import server.fleet.handle", "protocol translations know no worker"),
        ("server/protocol/tgi.py", "import server.edge.context", "router's packages keep their layers"),
        ("server/routing/router.py", "import server.edge.context", "router's packages keep their layers"),
        ("server/fleet/handle.py", "import server.canary.compare", "router's packages keep their layers"),
        ("server/config/settings.py", "import server.routing.router", "router's packages keep their layers"),
    ],
)
def test_a_violation_breaks_its_contract(tmp_path, module, line, contract):
    """Each contract fails when its rule is broken: one forbidden import is added to a copy of
    the packages, and `lint-imports` must name that contract as broken."""
    for name in ("server", "workers", "kernels_local"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "default_model"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # deliberately forbidden\n")
    r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                        "from importlinter.cli import lint_imports_command; lint_imports_command()",
                        "--config", "pyproject.toml", "--no-cache"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    broken = [ln for ln in r.stdout.splitlines() if ln.endswith("BROKEN") or " BROKEN " in ln]
    assert any(contract in ln for ln in broken), r.stdout
