"""End to end: `hetserve serve --model FILE.gguf` answers /generate with transformers' greedy tokens.

A tiny random Llama written by gguf-py's `GGUFWriter` in Q8_0 (tests/gguf_checkpoints.py) is
served in float32 by a real router over a simulated mixed host (Volta to Hopper beside a CPU):
the router prepares the file
(config, tokenizer and template converted into its cache directory; the file is kept under
`~/.cache/hetserve/test-gguf/`, so that directory is made once), every worker keeps the blocks
packed (the GPUs for the Triton kernels, the CPU for its C++ GEMV), and a greedy `/generate` on
each worker gives the tokens transformers generates loading the same file. A Q4_K_M-like file
(Q4_K, Q6_K, Q8_0 per tensor) served under `TRITON_INTERPRET=1` runs the sm_80 worker's packed
layers through the Triton kernels themselves: its greedy tokens are the CPU worker's (its C++
kernel), its logprobs within fp32 rounding.
The model is named by its file; a file whose architecture we do not serve stops `serve` with one
line before any worker starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gguf_checkpoints import cached_gguf, make_gguf
from tests.router_harness import RouterProcess
from tests.test_gguf_load import _rewrite
from workers.gguf.prepare import prepare

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

PROMPT = "Once upon a time there was a little fox who lived near the river, and every morning it went down"
NEW_TOKENS = 24
MIXED = "sm_70,sm_75,sm_86,sm_90,cpu"  # one GGUF file on every kind of device a mixed host holds
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served():
    path = cached_gguf("llama", "Q8_0")
    router = RouterProcess(["--model", str(path), "--dtype", "float32", "--max-batch", "4", "--simulate", MIXED],
                           fake=False, ready_timeout=300)
    yield path, router
    router.stop()
    assert not router.orphans, f"workers left running: {router.orphans}"


def test_a_gguf_file_over_http_generates_transformers_greedy_tokens_on_every_device_of_a_mixed_host(served):
    """Every worker of a host mixing Volta, Turing, Ampere, Hopper and a CPU serves the one file,
    says how it runs its blocks and why, and its device's rule (`model.gguf`, workers/gguf/execution.py), and answers
    transformers' greedy tokens."""
    path, router = served
    workers = router.workers()
    assert len(workers) == len(MIXED.split(","))
    answers = {}
    with router.client(timeout=120) as c:
        for w in workers:
            gguf = w["model"]["gguf"]
            assert gguf["types"] == {"F32": gguf["types"]["F32"], "Q8_0": gguf["types"]["Q8_0"]}, gguf
            cap = w["device"].get("capability")
            device = f"sm_{str(cap).replace('.', '')}" if cap else "cpu"
            # the device's rule: CUDA from sm_70 keeps the blocks packed for Triton, the CPU for its C++ GEMV
            assert gguf["rule"]["execution"] == "packed", (w["device"], gguf)
            assert gguf["rule"]["reason"].startswith("CPU" if device == "cpu" else device), (w["device"], gguf)
            # every projection holds its Q8_0 blocks (2 x (wqkv, wo, gate/up, down)); the tied head too on the CPU,
            # where the embedding reads its blocks (the file's bytes, all of them), dense elsewhere
            layers = 9 if device == "cpu" else 8
            assert gguf["execution"].startswith(f"packed ({layers} layers: Q8_0 {layers})"), gguf
            variant = w["kernels"]["GGUFLinear"]["variant"]
            assert variant == "cpp-gemv" if device == "cpu" else variant.startswith("triton-sm"), (device, variant)
            assert 0 < gguf["packed_bytes"] == gguf["resident_bytes"] if device == "cpu" else \
                0 < gguf["packed_bytes"] < gguf["resident_bytes"], gguf
            r = c.post("/generate", headers={"X-Hetserve-Worker": w["id"]}, json={"inputs": PROMPT, "parameters": {
                "max_new_tokens": NEW_TOKENS, "details": True, "decoder_input_details": True}})
            assert r.status_code == 200 and r.headers["x-worker-id"] == w["id"], r.text
            answers[w["id"]] = r.json()["details"]
        models = c.get("/v1/models").json()["data"]
    details = answers[workers[0]["id"]]
    prompt = [t["id"] for t in details["prefill"]]
    got = [t["id"] for t in details["tokens"]]
    assert all([t["id"] for t in d["tokens"]] == got for d in answers.values()), answers
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert prompt[1:] == tok.encode(PROMPT, add_special_tokens=False) and prompt[0] == 1  # BOS, as the file says
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=2)
    assert got == out[0, len(prompt):].tolist()
    assert [m["id"] for m in models] == [path.stem]
    assert prepare(path) == prepare(path)  # the directory the router prepared, reused


def test_packed_blocks_through_the_triton_kernels_answer_the_dequantized_workers_tokens():
    """The sm_80 worker's GGUF layers hold the blocks and run kernels_local/gguf_linear's GEMM (prompt) and
    GEMV (decode) in Triton's interpreter; the CPU worker runs the same blocks through its C++ kernel."""
    path = cached_gguf("llama", "Q4_K_M")
    router = RouterProcess(["--model", str(path), "--dtype", "float32", "--max-batch", "2", "--compile", "off",
                            "--simulate", "sm_80,cpu", "--canary-interval", "0"],  # its 8 x 16 tokens: interpreted
                           env={"TRITON_INTERPRET": "1"}, fake=False, ready_timeout=300)
    try:
        workers = {("cpu" if w["device"]["type"] == "cpu" else "gpu"): w for w in router.workers()}
        assert workers["gpu"]["model"]["gguf"]["execution"].startswith("packed ("), workers["gpu"]["model"]["gguf"]
        assert workers["cpu"]["model"]["gguf"]["execution"].startswith("packed ("), workers["cpu"]["model"]["gguf"]
        answers = {}
        with router.client(timeout=600) as c:
            for kind, w in workers.items():
                r = c.post("/generate", headers={"X-Hetserve-Worker": w["id"]}, json={
                    "inputs": "Once upon a time there was a fox", "parameters": {  # the interpreter is slow
                        "max_new_tokens": 2, "details": True, "decoder_input_details": True}})
                assert r.status_code == 200 and r.headers["x-worker-id"] == w["id"], r.text
                answers[kind] = r.json()["details"]
    finally:
        router.stop()
    assert not router.orphans, f"workers left running: {router.orphans}"
    gpu, cpu = answers["gpu"], answers["cpu"]
    assert [t["id"] for t in gpu["tokens"]] == [t["id"] for t in cpu["tokens"]]
    for got, want in zip(gpu["prefill"][1:] + gpu["tokens"], cpu["prefill"][1:] + cpu["tokens"], strict=True):
        assert abs(got["logprob"] - want["logprob"]) < 1e-4, (got, want)


def test_an_unserved_gguf_architecture_stops_serve_with_one_line(tmp_path):
    bad = _rewrite(make_gguf("llama", "F32", tmp_path / "files"), tmp_path / "mamba.gguf", arch="mamba")
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(bad)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Unsupported GGUF architecture `mamba`. Supported: llama, qwen2, qwen3" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_plan_reads_a_gguf_file_as_a_model():
    """`hetserve plan --model FILE.gguf` describes the model from its prepared directory (the line in
    server/commands/plan_model.py that hands the child that directory, not the file)."""
    path = cached_gguf("llama", "Q8_0")
    done = subprocess.run([sys.executable, "-m", "server.cli", "plan", "--model", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"placement: {path.stem} on cpu0" in done.stdout and ": llama (rope default)" in done.stdout


def test_plan_counts_a_gguf_files_packed_blocks_where_the_device_keeps_them():
    """`hetserve plan` sizes a Q4_K_M-like file per device: its blocks on sm_80 (which lists the GGUF kernel
    layer) and on the CPU (whose kernel decodes the same three types, and the tied head's), the dequantized
    size on sm_61
    (workers/contract/model_size.py `need_on`'s GGUF lines)."""
    import json

    path = cached_gguf("llama", "Q4_K_M")
    done = subprocess.run([sys.executable, "-m", "server.cli", "plan", "--model", str(path), "--simulate",
                           "sm_80,sm_61,cpu", "--dtype", "float32", "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    needs = {d["device"].get("capability") or "cpu": d["need"] for d in json.loads(done.stdout)["placement"]["devices"]}
    assert [needs[d]["gguf"] for d in ("8.0", "cpu", "6.1")] == ["packed", "packed", "dequantized"], needs
    # the CPU also keeps the tied head's (the embedding's) blocks, which sm_80 dequantizes
    assert needs["cpu"]["weight_bytes"] < needs["8.0"]["weight_bytes"] < 0.75 * needs["6.1"]["weight_bytes"]
    text = subprocess.run([sys.executable, "-m", "server.cli", "plan", "--model", str(path), "--simulate", "sm_80"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    assert "GGUF blocks packed" in text and "\n  GGUFLinear      triton-sm80" in text, text
