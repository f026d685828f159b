"""The project passes its own linter (pyproject.toml `[tool.ruff]`: pycodestyle, pyflakes, isort, bugbear,
pyupgrade, lines of at most 120 characters), so a change that breaks the style fails here, not in review."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff() -> str:
    local = Path(sys.executable).with_name("ruff")
    found = str(local) if local.exists() else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: it is a dev dependency (pip install -e '.[dev]')")
    return found


def test_ruff_check_passes():
    result = subprocess.run([_ruff(), "check", "--output-format", "concise", str(ROOT)],
                            capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_sees_long_lines(tmp_path):
    """Guards `line-length = 120` with E501 selected: a 121-character line is reported."""
    bad = tmp_path / "long.py"
    bad.write_text("x = '" + "a" * 115 + "'\n")  # 121 characters
    result = subprocess.run([_ruff(), "check", "--config", str(ROOT / "pyproject.toml"),
                             "--output-format", "concise", str(bad)],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "E501" in result.stdout, result.stdout + result.stderr
