#!/usr/bin/env bash
# The checks that need a real GPU, as one run that fits one lease (8 minutes on one H100 or H200) and
# ends with one summary table (scripts/gpu_summary.py), printed and written to $OUT/summary.txt; every
# step's output and every worker's log go to $OUT/logs.tar.gz (two files under $OUT, default
# /tmp/gpu-check). Uses the machine's python3 (with its CUDA torch and Triton); packages it lacks
# (kernels, fastapi, uvicorn, pydantic, ...) are installed first from the wheels in .whl/, which
# scripts/gpu_wheels.sh fills on a machine that reaches PyPI (carry .whl/ with the checkout).
#
# Design: each step runs under coreutils `timeout` with its own budget, clamped to what is left of the
# run (GPU_CHECK_SECONDS, default 470), so one hung step costs its budget, never the lease, and a step
# that no longer fits is reported as skipped. The correctness checks run side by side first; the timed
# ones (eager against CUDA graphs, kernel benchmarks) run one at a time afterwards, so nothing else
# shares the GPU while they are timed. The embedded model's worker starts first and alone among the
# workers: its preflight fills the Triton cache that the later ones read. Exit status: 0 when every
# row of the summary is fine. What runs:
#  - the gpu-marked tests (the files that hold the marker; the real kernels' self-tests, the W4A16
#    and MXFP4 kernels' gpu tests, ...);
#  - the preflight on the real device compared record by record with `hetserve plan --compile
#    --simulate <its arch>` (they must agree);
#  - workers bound to the GPU, each answering /capability and /generate (their start runs the
#    preflight and the self-test): the embedded model with the default flags; a 4-bit AWQ checkpoint of
#    it (groups of 128: the W4A16 layer); a block-wise fp8 checkpoint of it (the fp8 checkpoint
#    kernels); a tiny gpt-oss with MXFP4 experts (written by transformers, if this python has it: the
#    Mxfp4FusedMoE Triton layer) — /capability names each execution;
#  - benchmarks/triton_kernels.py, one run per kernel (RMSNorm, SiluAndMul, Fp8Linear, the paged
#    decode kernel with each layer option the families set: head dim 256, soft-capped scores, sliding
#    windows; the fused MoE on Qwen3-30B-A3B and gpt-oss-20b expert shapes; the LoRA delta of a batch
#    mixing four adapters and base rows, decode and prefill): every tuning checked
#    against torch, then timed against it; a kernel that disagrees stops only its own run;
#  - the fp8 checkpoint kernels (W8A16, block-scaled W8A8, the fp8 experts' grouped GEMM weight-only
#    and native: benchmarks/fp8_checkpoint.py --kernels) and the W4A16 kernel in every tuning this GPU
#    runs (benchmarks/int4_checkpoint.py --kernels) and the GGUF GEMV and GEMM in the tuning this GPU
#    selects, every block type, and the GGUF experts' grouped GEMM (benchmarks/gguf_kernels.py) against
#    their torch references, timed against the 16-bit matmul (the experts: against a launch per expert);
#  - the decode step eager (--compile off) and as CUDA graphs captured per batch bucket (--compile on):
#    tokens/s at batch 1 and 32 and whether their greedy tokens agree (both workers start with the
#    correctness checks; only their measurements wait for the quiet GPU).
#
#   scripts/gpu_check.sh                          # OUT=/tmp/gpu-check
#   OUT=/some/dir GPU_CHECK_SECONDS=560 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
SELF="$PWD/scripts/gpu_check.sh"
export PY="${PYTHON:-python3}"
export WORK="${GPU_CHECK_WORK:-/tmp/gpu-check-work}"
export KV_BYTES="${GPU_CHECK_KV_BYTES:-$((2 << 30))}"  # each worker's KV cache: several share the GPU while the checks run side by side

# ---- one step, run by `gpu_check.sh --step NAME ARGS...` under `timeout` (its output: $WORK/NAME.txt) ----

# a worker on the GPU: start_worker NAME [FLAGS...] (socket $WORK/NAME.sock, status $WORK/NAME.json, log
# $WORK/NAME.log, pid $WORK/NAME.pid); returns once it is ready (0) or failed or gone (1)
start_worker() {
  local name="$1"; shift
  rm -f "$WORK/$name.json" "$WORK/$name.sock"
  "$PY" -m workers --socket "$WORK/$name.sock" --status-file "$WORK/$name.json" --kv-cache-bytes "$KV_BYTES" \
    "$@" >"$WORK/$name.log" 2>&1 &
  local pid=$!
  echo "$pid" >"$WORK/$name.pid"
  while kill -0 "$pid" 2>/dev/null; do
    if grep -qE '"state": "(ready|failed|fatal)"' "$WORK/$name.json" 2>/dev/null; then break; fi
    sleep 1
  done
  cat "$WORK/$name.json" 2>/dev/null; echo
  grep -q '"state": "ready"' "$WORK/$name.json" 2>/dev/null
}

# the worker NAME's status, /capability and one /generate, as $WORK/NAME.probe.json (and a few lines here)
probe() {
  "$PY" - "$WORK/$1" <<'PY'
import http.client, json, socket, sys

base = sys.argv[1]

class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(base + ".sock")

def call(method, path, body=None, timeout=60):
    try:
        c = Unix("w", timeout=timeout)
        c.request(method, path, json.dumps(body) if body else None, {"content-type": "application/json"})
        r = c.getresponse()
        text = r.read().decode(errors="replace")
        try:
            return {"status": r.status, "body": json.loads(text)}
        except ValueError:
            return {"status": r.status, "text": text[:2000]}
    except Exception as e:  # noqa: BLE001 - the summary says what went wrong
        return {"error": f"{type(e).__name__}: {e}"}

try:
    status = json.load(open(base + ".json"))
except (OSError, ValueError) as e:
    status = {"state": "no status file", "reason": str(e)}
record = {"status_file": status}
calls = [("capability", "GET", "/capability", None),
         ("generate", "POST", "/generate", {"inputs": "The meaning of life is", "parameters": {"max_new_tokens": 24}})]
for key, method, path, body in calls if status.get("state") == "ready" else ():
    # written before each call: a step whose time runs out mid-call still leaves what it had
    record[key] = {"error": "no answer before the step's time ran out"}
    json.dump(record, open(base + ".probe.json", "w"), indent=1)
    record[key] = call(method, path, body)
json.dump(record, open(base + ".probe.json", "w"), indent=1)
cap = record.get("capability", {}).get("body") or {}
print("state:", status.get("state"), status.get("step", ""), status.get("reason", ""))
print("device:", json.dumps(cap.get("device")))
print("fp8:", json.dumps(cap.get("fp8")))
print("compile:", json.dumps(cap.get("compile")))
print("kernels:", json.dumps({k: v.get("variant") for k, v in (cap.get("kernels") or {}).items()}))
print("generate:", json.dumps(record.get("generate")))
PY
}

stop_worker() {
  local pid
  pid="$(cat "$WORK/$1.pid" 2>/dev/null)" || return 0
  kill "$pid" 2>/dev/null || return 0
  for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
  kill -9 "$pid" 2>/dev/null
}

# eager or graphs: the best of 3 rounds of tokens/s at batch 1 and 32 (128 tokens each, greedy), and
# the tokens of the last round in $WORK/NAME.tokens.json for the agreement check
throughput() {
  "$PY" - "$WORK/$1" "$2" <<'PY'
import http.client, json, socket, sys, threading, time

base, mode = sys.argv[1], sys.argv[2]

class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(base + ".sock")

def generate(i, out):
    body = {"inputs": f"Request {i}: the meaning of life is", "parameters": {
        "max_new_tokens": 128, "ignore_eos": True, "details": True}}
    c = Unix("w", timeout=300)
    c.request("POST", "/generate", json.dumps(body), {"content-type": "application/json"})
    out[i] = [t["id"] for t in json.loads(c.getresponse().read())["details"]["tokens"]]

def compile_state():
    c = Unix("w", timeout=30)
    c.request("GET", "/capability")
    return (json.loads(c.getresponse().read()).get("compile") or {}).get("state")

# a step compiled behind the serving is measured once it is in use (or has failed): not while still eager
t0 = time.perf_counter()
while (state := compile_state()) in ("waiting", "compiling") and time.perf_counter() - t0 < 60:
    time.sleep(1)
print(f"compile {mode}: step {state} after {time.perf_counter() - t0:.0f}s of waiting", flush=True)
tokens = {}
for batch in (1, 32):
    generate(0, {})  # warm-up
    best = 0.0
    for _ in range(3):
        out = {}
        threads = [threading.Thread(target=generate, args=(i, out)) for i in range(batch)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = max(best, sum(map(len, out.values())) / (time.perf_counter() - t0))
    tokens[batch] = out
    print(f"compile {mode}: batch {batch}: {best:.0f} tokens/s", flush=True)
json.dump({str(k): v for k, v in tokens.items()}, open(base + ".tokens.json", "w"))
PY
}

run_step() {
  local name="$1"; shift
  case "$name" in
    env)
      "$PY" - <<'PY'
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
if not torch.cuda.is_available():
    raise SystemExit("device: none (torch sees no CUDA device)")
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
PY
      ;;
    gpu-tests)  # only the files holding the marker: collecting the whole suite imports what this image lacks
      mapfile -t files < <(grep -lE 'mark\.gpu\b' tests/test_*.py)
      "$PY" -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors "${files[@]}"
      ;;
    preflight)  # the real device's preflight against `hetserve plan --compile` simulating its architecture
      "$PY" -m workers.kernelize >"$WORK/preflight-real.json" 2>"$WORK/preflight-real.log" || {
        tail -n 20 "$WORK/preflight-real.log"; return 1; }
      local arch
      arch="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["arch"])' "$WORK/preflight-real.json")"
      echo "arch $arch"
      "$PY" -m server.cli plan --compile --simulate "$arch" --json >"$WORK/preflight-simulated.json" || return 1
      "$PY" -m workers.kernelize --compare "$WORK/preflight-real.json" "$WORK/preflight-simulated.json"
      ;;
    checkpoints)  # on the CPU: the 4-bit AWQ and block fp8 checkpoints of the embedded model, a tiny MXFP4 gpt-oss
      CUDA_VISIBLE_DEVICES="" "$PY" - "$WORK" <<'PY'
import shutil, sys
from pathlib import Path

from tests.fp8_checkpoints import block_fp8_checkpoint
from tests.int4_checkpoints import quantize_checkpoint
from workers.contract import DEFAULT_MODEL_DIR

work = Path(sys.argv[1])
for d in ("int4-awq", "fp8-block", "mxfp4"):
    shutil.rmtree(work / d, ignore_errors=True)
print("int4 checkpoint", quantize_checkpoint(DEFAULT_MODEL_DIR, work / "int4-awq", "awq", 128, False)[0], flush=True)
print("fp8 checkpoint", block_fp8_checkpoint(work / "fp8-block"), flush=True)
try:  # transformers writes the tiny gpt-oss
    from tests.family_checkpoints import make_family_checkpoint
    from tests.mxfp4_checkpoints import mxfp4_checkpoint

    print("mxfp4 checkpoint", mxfp4_checkpoint(make_family_checkpoint("gpt_oss", work / "mxfp4" / "src"),
                                               work / "mxfp4" / "mx"))  # fmt: skip
except ImportError as e:
    print("mxfp4 checkpoint skipped:", e)
PY
      ;;
    serve)  # serve NAME [FLAGS...]: a worker started, probed and stopped
      local w="$1"; shift
      start_worker "$w" "$@"; local rc=$?
      probe "$w"
      stop_worker "$w"
      return "$rc"
      ;;
    start)  # start NAME [FLAGS...]: a worker left serving for a later step (stopped by the run's end)
      start_worker "$@"
      ;;
    probe)  # probe NAME: a running worker probed, then stopped
      probe "$1"; local rc=$?
      stop_worker "$1"
      return "$rc"
      ;;
    throughput)  # throughput NAME MODE: measured on a running worker, then probed and stopped
      throughput "$1" "$2"; local rc=$?
      probe "$1"
      stop_worker "$1"
      return "$rc"
      ;;
    triton-kernels)  # triton-kernels KERNEL: one kernel of benchmarks/triton_kernels.py
      "$PY" benchmarks/triton_kernels.py --rounds 30 --only "$1"
      ;;
    fp8-kernels)
      "$PY" benchmarks/fp8_checkpoint.py --kernels
      ;;
    int4-kernels)
      "$PY" benchmarks/int4_checkpoint.py --kernels
      ;;
    gguf-kernels)
      "$PY" benchmarks/gguf_kernels.py
      ;;
    *) echo "unknown step \`$name\`"; return 2 ;;
  esac
}

if [ "${1:-}" = "--step" ]; then
  shift
  run_step "$@"
  exit $?
fi

# ---- the run ----

OUT="${OUT:-/tmp/gpu-check}"
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_SECONDS:-470}))
RESERVE=20  # the summary and the tarball
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
: >"$WORK/steps.tsv"
trap 'for f in "$WORK"/*.pid; do [ -e "$f" ] && kill "$(cat "$f")" 2>/dev/null; done' EXIT
trap 'exit 143' TERM INT  # the workers left serving are stopped by the EXIT trap then too

# step NAME BUDGET_S UNTIL [--as LABEL] ARGS...: `run_step NAME ARGS` within BUDGET_S seconds and before UNTIL
# (epoch seconds; the run's deadline less the reserve at most); output in $WORK/LABEL.txt (LABEL: NAME), a
# line "LABEL rc seconds budget" in $WORK/steps.tsv (rc 124 or 137: timed out; "skipped": no time left)
step() {
  local name="$1" budget="$2" until="$3"; shift 3
  local label="$name"
  if [ "${1:-}" = "--as" ]; then label="$2"; shift 2; fi
  local cap=$((DEADLINE - RESERVE))
  [ "$until" -lt "$cap" ] || until=$cap
  local left=$((until - $(date +%s)))
  [ "$budget" -lt "$left" ] || budget=$left
  if [ "$budget" -lt 10 ]; then
    printf '%s\tskipped\t0\t0\n' "$label" >>"$WORK/steps.tsv"
    echo "-- $label: skipped, no time left"
    return 0
  fi
  local t0
  t0=$(date +%s)
  timeout -k 10 "$budget" bash "$SELF" --step "$name" "$@" >"$WORK/$label.txt" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\t%s\n' "$label" "$rc" "$(($(date +%s) - t0))" "$budget" >>"$WORK/steps.tsv"
  echo "-- $label: rc $rc in $(($(date +%s) - t0))s (budget ${budget}s)"
  [ "$rc" -eq 0 ] || tail -n 4 "$WORK/$label.txt" | cut -c1-300
}

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
    >"$WORK/wheels.txt" 2>&1 || { cat "$WORK/wheels.txt"; exit 1; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

step env 60 "$DEADLINE"
grep -q "^env	0	" "$WORK/steps.tsv" && cat "$WORK/env.txt"  # a failed step printed its tail
# 1. correctness, side by side: tests, preflight, workers (the two compiled-step workers start here too)
phase_a=$((START + 240))
step gpu-tests 220 "$phase_a" &
step preflight 180 "$phase_a" &
(
  step checkpoints 120 "$phase_a" &
  checkpoints=$!
  # the embedded model first, alone: its preflight fills the Triton cache the later workers read
  step start 180 "$phase_a" --as start-embedded embedded
  step probe 90 "$phase_a" --as serve-embedded embedded &
  step start 150 "$phase_a" --as start-compile-off compile-off --compile off --max-batch 32 &
  step start 150 "$phase_a" --as start-compile-on compile-on --compile on --max-batch 32 &
  wait "$checkpoints"
  step serve 150 "$phase_a" --as serve-int4 int4 --model "$WORK/int4-awq" &
  step serve 150 "$phase_a" --as serve-fp8 fp8 --model "$WORK/fp8-block" &
  if [ -d "$WORK/mxfp4/mx" ]; then step serve 150 "$phase_a" --as serve-mxfp4 mxfp4 --model "$WORK/mxfp4/mx" & fi
  wait
) &
wait
# 2. timed, one at a time on a quiet GPU
for mode in off on; do
  if grep -q '"state": "ready"' "$WORK/compile-$mode.json" 2>/dev/null; then
    step throughput 90 "$DEADLINE" --as "throughput-$mode" "compile-$mode" "$mode"
  else
    printf 'throughput-%s\tnot ready\t0\t0\n' "$mode" >>"$WORK/steps.tsv"
  fi
done
for kernel in rmsnorm silu fp8 paged moe lora; do
  step triton-kernels 60 "$DEADLINE" --as "kernels-$kernel" "$kernel"
done
step fp8-kernels 60 "$DEADLINE"
step int4-kernels 60 "$DEADLINE"
step gguf-kernels 150 "$DEADLINE"

# 3. the summary, and every log in one tarball
for f in "$WORK"/*.pid; do [ -e "$f" ] && stop_worker "$(basename "$f" .pid)"; done
"$PY" scripts/gpu_summary.py "$WORK" | tee "$OUT/summary.txt"
fine=${PIPESTATUS[0]}
tar -czf "$OUT/logs.tar.gz" -C "$WORK" --exclude='*.sock' --exclude=int4-awq --exclude=fp8-block --exclude=mxfp4 .
echo "gpu_check: $(($(date +%s) - START))s; summary $OUT/summary.txt, logs $OUT/logs.tar.gz"
exit "$fine"
