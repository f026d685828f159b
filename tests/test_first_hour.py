"""What a new user meets first: `hetserve --version`, the install split (serving needs only the
runtime dependencies; the tests add the development extras)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_version_prints_the_installed_distributions():
    r = subprocess.run([sys.executable, "-m", "server.cli", "--version"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"hetserve {version('hetserve')}"


def test_serving_installs_the_runtime_only_and_the_tests_the_extras():
    """Guards the modes of scripts/bootstrap.sh: `./scripts/serve` asks for no mode (the runtime
    dependencies), `./scripts/test` for `dev`; an unknown mode is refused with the accepted ones."""
    assert '"$root/scripts/bootstrap.sh"\n' in (ROOT / "scripts" / "serve").read_text()
    assert '"$root/scripts/bootstrap.sh" dev\n' in (ROOT / "scripts" / "test").read_text()
    boot = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert 'runtime) target="." ;;' in boot and 'dev) target=".[dev]" ;;' in boot
    r = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap.sh"), "everything"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "unknown mode `everything`; accepted: runtime, dev" in r.stderr
