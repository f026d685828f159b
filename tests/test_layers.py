"""The layers between the processes, enforced by import-linter (contracts in pyproject.toml).

The router imports from `workers` only the torch-free contract and topology, the contract
stays torch-free, workers never import the router, kernel repositories import neither, and
nothing in the router imports torch. `tests/test_router_no_cuda.py` checks the last one at
run time too.
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
        ("server/balancer.py", "import workers.engine", "only the torch-free contract and topology"),
        ("server/balancer.py", "import torch", "never imports torch"),
        ("workers/contract/defaults.py", "import torch", "stay light"),
        ("workers/sampling.py", "import server.app", "never import the router"),
        ("kernels_local/rmsnorm/layers.py", "import workers.fp8", "Kernel repositories import neither"),
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
