#!/usr/bin/env bash
# Fill .whl/ with the wheels scripts/gpu_check.sh needs on a GPU machine that reaches no registry.
#
# Run here, where PyPI is reachable; then carry .whl/ with the checkout to the GPU machine, where
# gpu_check.sh installs every wheel in it into a private target first (no index, no dependencies
# resolved there). Design: the GPU image already holds torch, Triton and most of what hetserve
# imports (IMAGE_HOLDS below, as read from that machine's notes); a wheel of a package it holds would
# shadow its own build on PYTHONPATH, so only what it lacks is fetched: every pin of
# deploy/constraints.txt missing from IMAGE_HOLDS, at its exact version, plus the dev-only packages
# gpu_check.sh's steps import (DEV_EXTRA). Binary wheels only, for CPython 3.12 on manylinux x86_64:
# a platform tag list is tried first, then other manylinux_2_N tags one by one. The total travels
# with the checkout (64 MiB at most there), so it is printed, and more than LIMIT_MIB fails.
#
#   scripts/gpu_wheels.sh                  # .whl/ for the GPU image (cp312)
#   GPU_PYTHON_VERSION=3.11 WHL_DIR=/tmp/whl311 scripts/gpu_wheels.sh   # the same set for another python
set -euo pipefail
cd "$(dirname "$0")/.."
WHL_DIR="${WHL_DIR:-.whl}"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
PIP="${PIP:-$(command -v pip3 || command -v pip)}"
LIMIT_MIB="${LIMIT_MIB:-48}"  # of the 64 MiB a device call carries, the rest is the checkout itself
# The GPU image's Python packages, as its notes listed them on 2026-12-06 (torch 2.11+cu130, triton 3.6).
IMAGE_HOLDS="accelerate aiohttp anyio certifi charset-normalizer click filelock fsspec h11 hf-xet httpcore
httpx huggingface-hub idna jinja2 markdown-it-py markupsafe mdurl mpmath msgpack networkx ninja numpy nvidia-ml-py
packaging peft pillow prometheus-client psutil pygments pytest pytest-timeout pyyaml regex requests rich safetensors
scipy sentencepiece setuptools sympy tokenizers torch tqdm transformers triton typing-extensions urllib3 uvloop"
# Dev-only packages gpu_check.sh's steps import that deploy/constraints.txt does not pin (name==version);
# the gpu-marked tests, the kernel benchmarks, the checkpoint writers and a worker's start need none today.
DEV_EXTRA=""

norm() { tr '[:upper:]_.' '[:lower:]--' <<<"$1"; }
holds=" $(for p in $IMAGE_HOLDS; do printf '%s ' "$(norm "$p")"; done)"
wanted=()
while IFS= read -r line; do
  line="${line%%#*}"; line="${line// /}"
  [ -n "$line" ] || continue
  name="$(norm "${line%%==*}")"
  case "$holds" in *" $name "*) continue ;; esac
  wanted+=("$line")
done < <(cat deploy/constraints.txt; for p in $DEV_EXTRA; do echo "$p"; done)
[ "${#wanted[@]}" -gt 0 ] || { echo "gpu_wheels: nothing to fetch: the image holds every pin"; exit 0; }

mkdir -p "$WHL_DIR"
rm -f "$WHL_DIR"/*.whl
base=(download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp -q -d "$WHL_DIR")
failed=()
for pin in "${wanted[@]}"; do
  if "$PIP" "${base[@]}" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 "$pin" 2>/dev/null; then
    continue
  fi
  ok=""
  for n in 24 27 31 34 35; do
    if "$PIP" "${base[@]}" --platform "manylinux_2_${n}_x86_64" "$pin" 2>/dev/null; then ok=1; break; fi
  done
  [ -n "$ok" ] || failed+=("$pin")
done

exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"

count="$(find "$WHL_DIR" -maxdepth 1 -type f -name '*.whl' | wc -l)"
kib="$(du -sk "$WHL_DIR" | cut -f1)"
echo "gpu_wheels: ${count} wheels for ${#wanted[@]} pins in ${WHL_DIR}/, $((kib / 1024)) MiB (${kib} KiB; limit ${LIMIT_MIB} MiB)"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "gpu_wheels: no cp${PYVER/./} manylinux x86_64 wheel for: ${failed[*]}" >&2
  exit 1
fi
if [ "$kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "gpu_wheels: ${WHL_DIR}/ holds $((kib / 1024)) MiB, over the ${LIMIT_MIB} MiB that may travel with the checkout" >&2
  exit 1
fi
