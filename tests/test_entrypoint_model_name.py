"""The container's entry point names the model mounted at /models (deploy/entrypoint.sh).

A bare `--model /models` would serve it as `models`, after the mount point; the entry point
passes `--model NAME=/models` instead, NAME from `$HETSERVE_MODEL_NAME`, else the last part of
config.json's `_name_or_path`, else nothing (the directory's name). A fake `hetserve` prints its
arguments, one per line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


@pytest.fixture()
def env(tmp_path) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "hetserve"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    python = shutil.which("python3")
    assert python is not None
    (bindir / "python3").symlink_to(python)
    (tmp_path / "models").mkdir()
    return {"PATH": f"{bindir}:/usr/bin:/bin", "HETSERVE_MODEL_DIR": str(tmp_path / "models")}


def _model_arg(env: dict, config: object, *argv: str) -> tuple[list[str], str]:
    Path(env["HETSERVE_MODEL_DIR"], "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    r = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), *argv], capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    i = out.index("--model")
    return out[i:i + 2], r.stderr


def test_the_mounted_model_takes_the_name_its_config_gives_it(env):
    """Guards `set -- --model "${name:+$name=}$model_dir"` in deploy/entrypoint.sh."""
    models = env["HETSERVE_MODEL_DIR"]
    arg, log = _model_arg(env, {"_name_or_path": "meta-llama/Llama-3.2-1B"})
    assert arg == ["--model", f"Llama-3.2-1B={models}"]
    assert f"serving the model mounted at {models} as Llama-3.2-1B" in log


def test_hetserve_model_name_wins_over_the_config(env):
    arg, _ = _model_arg({**env, "HETSERVE_MODEL_NAME": "chat"}, {"_name_or_path": "org/other"})
    assert arg == ["--model", f"chat={env['HETSERVE_MODEL_DIR']}"]


@pytest.mark.parametrize("config", [{}, {"_name_or_path": "/a dir/with spaces"}, {"_name_or_path": ""}, "not json",
                                    [1, 2]])
def test_without_a_valid_name_the_directory_is_served_bare(env, config):
    """A name `--model NAME=DIR` would refuse (spaces), none, or an unreadable config: the bare directory."""
    arg, _ = _model_arg(env, config)
    assert arg == ["--model", env["HETSERVE_MODEL_DIR"]]


def test_a_model_on_the_command_line_is_not_joined_by_the_mount(env):
    Path(env["HETSERVE_MODEL_DIR"], "config.json").write_text(json.dumps({"_name_or_path": "org/m"}))
    r = subprocess.run(["sh", str(DEPLOY / "entrypoint.sh"), "--model", "a=/data/a"], capture_output=True, text=True,
                       env=env, timeout=30)
    assert r.stdout.splitlines()[-2:] == ["--model", "a=/data/a"] and r.stdout.count("--model") == 1
