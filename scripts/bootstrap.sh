#!/usr/bin/env bash
# Creates .venv (once) and installs hetserve whenever pyproject.toml changed since the last
# install: `bootstrap.sh` the runtime dependencies only (what `./scripts/serve` needs),
# `bootstrap.sh dev` the development extras too (tests, linters, real clients, transformers).
# torch is pinned first, by pip (it honours the host's own wheels and index settings), so that the
# rest keeps the CPU build on hosts without a GPU instead of pulling a multi-GB CUDA build. The
# rest installs with uv (from PyPI: parallel downloads, a fresh dev install in about half a minute
# instead of pip's three) and with pip wherever uv cannot be had or fails.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
mode="${1:-runtime}"
case "$mode" in
  runtime) target="." ;;
  dev) target=".[dev]" ;;
  *) echo "[bootstrap] unknown mode \`$mode\`; accepted: runtime, dev" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3}"
TORCH_SPEC="${HETSERVE_TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=".venv/.hetserve-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
have="$(cat "$stamp" 2>/dev/null || true)"
# the dev install covers the runtime one; a runtime install does not cover dev
if [ "$have" != "$want dev" ] && { [ "$mode" = dev ] || [ "$have" != "$want runtime" ]; }; then
  echo "[bootstrap] installing $mode dependencies (first run takes a few minutes)" >&2
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
  if ! { .venv/bin/python -m pip install -q uv && .venv/bin/python -m uv pip install -q --python .venv/bin/python -e "$target"; }; then
    echo "[bootstrap] uv could not install it; installing with pip" >&2
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e "$target"
  fi
  echo "$want $mode" >"$stamp"
fi
