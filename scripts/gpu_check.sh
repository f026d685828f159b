#!/usr/bin/env bash
# The checks that need a real GPU, as one short run: the gpu-marked tests, one real worker
# bound to the GPU answering /generate (its start runs the kernel preflight and the self-test),
# the Triton kernel benchmark, and the preflight on the real device compared with the
# simulated plan of its architecture (they must agree). Writes logs under
# $OUT (default /tmp/gpu-check). Uses the machine's python3 (with its CUDA torch and Triton);
# packages it lacks (kernels, fastapi, uvicorn, pydantic, ...) can be placed as wheels in
# .whl/ (for example `pip download --no-deps --only-binary=:all: -d .whl kernels==0.17.2 ...`)
# and are installed into a private target first. The paged decode kernel is checked and timed
# with each layer option the model families set (head dim 256, soft-capped scores, sliding windows).
# The fused MoE kernel is checked (tests/test_kernels_moe.py, bf16 and exact fp32) and timed
# against its torch path on Qwen3-30B-A3B and gpt-oss-20b expert shapes; the fp8 checkpoint kernels
# (dense and experts) against their references (benchmarks/fp8_checkpoint.py --kernels). The decode step runs
# eager (--compile off) and as CUDA graphs captured per batch bucket (--compile on), and the
# tokens/s of both are printed at batch 1 and 32 with whether their greedy tokens agree.
# The 4-bit checkpoints' W4A16 kernel is checked against its torch reference (the gpu tests of
# tests/test_kernels_int4_linear.py in 1., every tuning this GPU runs in benchmarks/int4_checkpoint.py
# --kernels), and an AWQ checkpoint of the embedded model is served by a worker on the GPU (its
# start runs the preflight and the self-test through the W4A16 layer; /capability says the execution).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
"$PY" - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
PY
# 1. tests that need CUDA (they skip everywhere else)
"$PY" -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu-tests.txt"
# 2. one real worker on the GPU, then a request over its socket
sock="$OUT/w.sock"
"$PY" -m workers --socket "$sock" --status-file "$OUT/w.json" >"$OUT/worker.log" 2>&1 &
wpid=$!
for _ in $(seq 240); do grep -q '"ready"' "$OUT/w.json" 2>/dev/null && break; sleep 1; done
cat "$OUT/w.json"; echo
curl -s --unix-socket "$sock" http://w/capability | tee "$OUT/capability.json"; echo
curl -s --unix-socket "$sock" http://w/generate -H 'content-type: application/json' \
  -d '{"inputs": "The meaning of life is", "parameters": {"max_new_tokens": 24}}' | tee "$OUT/generate.json"; echo
kill "$wpid"; wait "$wpid"
# 3. our Triton kernels against torch, side by side
"$PY" benchmarks/triton_kernels.py --rounds 30 2>&1 | tee "$OUT/kernels.txt"
# 3b. pre-quantized fp8 checkpoints' kernels (W8A16, block-scaled W8A8, the fp8 experts' grouped GEMM
#     weight-only and native) against their torch references on this device, timed against bf16
"$PY" benchmarks/fp8_checkpoint.py --kernels 2>&1 | tee "$OUT/fp8-checkpoint-kernels.txt"
# 3c. 4-bit checkpoints' W4A16 kernel (each tuning this GPU can run: odd shapes, act-order, every group
#     kind, fp16/bf16/fp32 scales) against its torch reference, timed against the 16-bit matmul
"$PY" benchmarks/int4_checkpoint.py --kernels 2>&1 | tee "$OUT/int4-checkpoint-kernels.txt"
# 4. the preflight on the real device against `hetserve plan --compile` simulating its architecture
"$PY" -m workers.kernelize >"$OUT/preflight-real.json" 2>"$OUT/preflight-real.log"
arch="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["arch"])' "$OUT/preflight-real.json")"
"$PY" -m server.cli plan --compile --simulate "$arch" --json >"$OUT/preflight-simulated.json"
"$PY" -m workers.kernelize --compare "$OUT/preflight-real.json" "$OUT/preflight-simulated.json" \
  | tee "$OUT/preflight-compare.txt"
# 5. the decode step eager and as CUDA graphs per batch bucket: tokens/s at batch 1 and 32
# a worker as in 2.: start_worker NAME [FLAGS...] (socket $OUT/NAME.sock, status
# $OUT/NAME.json, log $OUT/NAME.log; sets $wpid once ready or failed)
start_worker() {
  local name="$1"; shift
  rm -f "$OUT/$name.json"
  "$PY" -m workers --socket "$OUT/$name.sock" --status-file "$OUT/$name.json" "$@" >"$OUT/$name.log" 2>&1 &
  wpid=$!
  for _ in $(seq 240); do grep -qE '"(ready|failed)"' "$OUT/$name.json" 2>/dev/null && break; sleep 1; done
  cat "$OUT/$name.json"; echo
}
for mode in off on; do
  start_worker "compile-$mode" --compile "$mode" --max-batch 32
  curl -s --unix-socket "$OUT/compile-$mode.sock" http://w/capability \
    | "$PY" -c 'import json, sys; print(json.dumps(json.load(sys.stdin).get("compile")))' \
    | tee "$OUT/compile-$mode-capability.json"
  "$PY" - "$OUT/compile-$mode.sock" "$mode" <<'PY' 2>&1 | tee "$OUT/compile-$mode.txt"
import http.client, json, socket, sys, threading, time

sock, mode = sys.argv[1], sys.argv[2]

class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sock)

def generate(i, out):
    body = {"inputs": f"Request {i}: the meaning of life is", "parameters": {
        "max_new_tokens": 128, "ignore_eos": True, "details": True}}
    c = Unix("w", timeout=600)
    c.request("POST", "/generate", json.dumps(body), {"content-type": "application/json"})
    out[i] = [t["id"] for t in json.loads(c.getresponse().read())["details"]["tokens"]]

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
    print(f"compile {mode}: batch {batch}: {best:.0f} tokens/s")
json.dump({str(k): v for k, v in tokens.items()}, open(sock + ".tokens.json", "w"))
PY
  kill "$wpid"; wait "$wpid"
done
"$PY" - "$OUT/compile-off.sock.tokens.json" "$OUT/compile-on.sock.tokens.json" <<'PY' | tee "$OUT/compile-compare.txt"
import json, sys
off, on = (json.load(open(p)) for p in sys.argv[1:])
for batch in off:
    same = sum(off[batch][i] == on[batch].get(i) for i in off[batch])
    print(f"batch {batch}: greedy tokens equal, eager vs graphs, in {same}/{len(off[batch])} requests")
PY
# 6. a 4-bit (AWQ, groups of 128) checkpoint of the embedded model served by a worker on this GPU: its
#    start runs the preflight and the self-test through the W4A16 layer; /capability names the execution
"$PY" - "$OUT/int4-awq" <<'PY' 2>&1 | tee "$OUT/int4-checkpoint.txt"
import shutil, sys
from pathlib import Path

from tests.int4_checkpoints import quantize_checkpoint
from workers.contract import DEFAULT_MODEL_DIR

out = Path(sys.argv[1])
shutil.rmtree(out, ignore_errors=True)
print("checkpoint", quantize_checkpoint(DEFAULT_MODEL_DIR, out, "awq", 128, False)[0])
PY
start_worker int4 --model "$OUT/int4-awq"
curl -s --unix-socket "$OUT/int4.sock" http://w/capability | "$PY" -c '
import json, sys
cap = json.load(sys.stdin)
q = cap["fp8"]["checkpoint"]["quantization"]
print("int4:", q["execution"], "-", q["reason"])
print("bytes held", q["weight_bytes"], "stored", q["stored_bytes"], "bf16", q["bf16_bytes"], "ratio", q["bf16_ratio"])
print("kernel:", json.dumps(cap["kernels"]["Int4CheckpointLinear"]))' | tee -a "$OUT/int4-checkpoint.txt"
curl -s --unix-socket "$OUT/int4.sock" http://w/generate -H 'content-type: application/json' \
  -d '{"inputs": "The meaning of life is", "parameters": {"max_new_tokens": 24}}' | tee -a "$OUT/int4-checkpoint.txt"; echo
kill "$wpid"; wait "$wpid"
# 7. gpt-oss's MXFP4 experts: the grouped GEMM decoding e2m1 in registers is checked against its torch
#    reference by the gpu tests of tests/test_mxfp4_kernel.py (in 1.: gpt-oss-20b expert shapes, bf16 and
#    fp32); here a tiny gpt-oss (written by transformers, if this python has it) with MXFP4 experts is served
#    by a worker on this GPU: from sm_80 its start runs the preflight and the self-test through the
#    Mxfp4FusedMoE Triton layer, and /capability names the execution (w4a16) and the bytes held
"$PY" - "$OUT/mxfp4" <<'PY' 2>&1 | tee "$OUT/mxfp4-checkpoint.txt"
import shutil, sys
from pathlib import Path

out = Path(sys.argv[1])
shutil.rmtree(out, ignore_errors=True)
try:
    from tests.family_checkpoints import make_family_checkpoint
    from tests.mxfp4_checkpoints import mxfp4_checkpoint

    print("checkpoint", mxfp4_checkpoint(make_family_checkpoint("gpt_oss", out / "src"), out / "mx"))
except ImportError as e:  # transformers writes the tiny gpt-oss
    print("mxfp4 checkpoint skipped:", e)
PY
if [ -d "$OUT/mxfp4/mx" ]; then
  start_worker mxfp4 --model "$OUT/mxfp4/mx"
  curl -s --unix-socket "$OUT/mxfp4.sock" http://w/capability | "$PY" -c '
import json, sys
cap = json.load(sys.stdin)
q = cap["fp8"]["checkpoint"]["quantization"]
print("mxfp4:", q["execution"], "-", q["reason"])
print("bytes held", q["weight_bytes"], "stored", q["stored_bytes"], "widened", q["widened_bytes"])
print("kernel:", json.dumps(cap["kernels"]["Mxfp4FusedMoE"]))' | tee -a "$OUT/mxfp4-checkpoint.txt"
  curl -s --unix-socket "$OUT/mxfp4.sock" http://w/generate -H 'content-type: application/json' \
    -d '{"inputs": "The meaning of life is", "parameters": {"max_new_tokens": 24}}' | tee -a "$OUT/mxfp4-checkpoint.txt"; echo
  kill "$wpid"; wait "$wpid"
fi
