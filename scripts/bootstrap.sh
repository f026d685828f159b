#!/usr/bin/env bash
# Creates .venv (once) and installs hetserve with its dev extras whenever pyproject.toml
# changed since the last install. torch is pinned first so that pip keeps the CPU build
# on hosts without a GPU instead of pulling a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
TORCH_SPEC="${HETSERVE_TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=".venv/.hetserve-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[bootstrap] installing dependencies (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" >"$stamp"
fi
