"""End to end: `hetserve serve --model FILE.gguf` answers /generate with transformers' greedy tokens.

A tiny random Llama written by gguf-py's `GGUFWriter` in Q8_0 (tests/gguf_checkpoints.py) is
served by a real router with one real CPU worker in float32: the router prepares the file
(config, tokenizer and template converted into its cache directory; the file is kept under
`~/.cache/hetserve/test-gguf/`, so that directory is made once), the worker dequantizes its
tensors, and a greedy `/generate` gives the tokens transformers generates loading the same file.
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
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served():
    path = cached_gguf("llama", "Q8_0")
    router = RouterProcess(["--model", str(path), "--dtype", "float32", "--max-batch", "4"], fake=False,
                           ready_timeout=300)
    yield path, router
    router.stop()
    assert not router.orphans, f"workers left running: {router.orphans}"


def test_a_gguf_file_over_http_generates_transformers_greedy_tokens(served):
    path, router = served
    with router.client(timeout=120) as c:
        r = c.post("/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": NEW_TOKENS, "details": True, "decoder_input_details": True}})
        assert r.status_code == 200, r.text
        details = r.json()["details"]
        models = c.get("/v1/models").json()["data"]
    prompt = [t["id"] for t in details["prefill"]]
    got = [t["id"] for t in details["tokens"]]
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
