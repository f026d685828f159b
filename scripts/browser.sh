#!/usr/bin/env bash
# Makes a headless Chromium available for the status page's browser test
# (tests/test_e2e_observability.py drives it with Playwright; no browser is downloaded by
# Playwright itself). Installs Debian's `chromium` with apt-get when it is missing and this
# runs as root; otherwise says why in .venv/.browser-unavailable, which the test shows as its
# skip reason. Never fails: the rest of the suite does not need a browser.
# HETSERVE_NO_BROWSER_INSTALL=1 skips the install.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
note="$root/.venv/.browser-unavailable"
mkdir -p "$root/.venv"
rm -f "$note"
found() { command -v chromium || command -v chromium-browser || command -v google-chrome; }
if [ -n "${HETSERVE_CHROMIUM:-}" ] || found >/dev/null; then
  exit 0
fi
why=""
if [ -n "${HETSERVE_NO_BROWSER_INSTALL:-}" ]; then
  why="HETSERVE_NO_BROWSER_INSTALL is set and no chromium is on PATH"
elif [ "$(id -u)" != "0" ]; then
  why="no chromium on PATH and not root, so scripts/browser.sh cannot apt-get install it (run: sudo apt-get install chromium)"
elif ! command -v apt-get >/dev/null; then
  why="no chromium on PATH and no apt-get to install it (install Chromium and set HETSERVE_CHROMIUM=/path/to/it)"
else
  echo "[browser] installing Debian's chromium for the status page test (about a minute)" >&2
  log="$(mktemp)"
  if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } >"$log" 2>&1; then
    why="apt-get install chromium failed: $(tail -n 3 "$log" | tr '\n' ' ')"
  fi
  rm -f "$log"
  found >/dev/null || why="${why:-apt-get installed chromium but it is not on PATH}"
fi
if [ -n "$why" ]; then
  echo "[browser] $why; the browser test will skip" >&2
  echo "$why" >"$note"
fi
exit 0
