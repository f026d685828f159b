"""End to end: `hetserve serve --speculative ngram` and `--speculative suffix` (k chosen per step
from the measured costs), on the embedded model (one CPU worker) answer greedy requests with the text of a
server without speculation, and `/workers` and `/metrics` show the drafts verified and the choice."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.router_harness import ROOT, RouterProcess
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]
BASE = ["--dtype", "float32", "--compile", "off", "--max-batch", "4"]
SEEDS = ["Tell me about grass.", "Name a fruit."]


def _generate(router: RouterProcess, text: str, n: int) -> str:
    with router.client(timeout=120) as c:
        r = c.post("/generate", json={"inputs": text, "parameters": {"max_new_tokens": n}})
        assert r.status_code == 200, r.text
        return r.json()["generated_text"]


def _stream(router: RouterProcess, text: str, n: int) -> str:
    """The streamed text: every token once, in order, only accepted ones."""
    with router.client(timeout=120) as c:
        r = c.post("/v1/completions", json={"prompt": text, "max_tokens": n, "temperature": 0, "stream": True})
        assert r.status_code == 200, r.text
        parts = [json.loads(line[6:]) for line in r.text.splitlines()
                 if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(p["choices"][0]["text"] for p in parts if p.get("choices"))


def test_ngram_and_suffix_speculation_give_the_plain_greedy_text():
    plain = RouterProcess(BASE + ["--speculative", "off"], fake=False, ready_timeout=240)
    try:
        # prompts that hold a text and end where it began: much of it is written again
        echoes = [seed + _generate(plain, seed, 24) + "\n" + seed for seed in SEEDS]
        expected = [_generate(plain, e, 32) for e in echoes]
        streamed = [_stream(plain, e, 32) for e in echoes]
        with plain.client(timeout=30) as c:
            assert c.get("/workers").json()["workers"][0]["speculative"]["method"] == "off"
    finally:
        plain.stop()
    servers = []
    for flags, method in ((["--speculative", "ngram"], "ngram"), (["--speculative", "suffix"], "suffix")):
        spec = RouterProcess(BASE + flags + ["--num-speculative-tokens", "4"], fake=False, ready_timeout=240)
        servers.append(spec)
        try:
            assert [_generate(spec, e, 32) for e in echoes] == expected
            assert [_stream(spec, e, 32) for e in echoes] == streamed
            with spec.client(timeout=30) as c:
                metrics = c.get("/metrics").text
                deadline = time.monotonic() + 30
                while True:  # /workers shows what the router's last /health probe of the worker said
                    described = c.get("/workers").json()["workers"][0]["speculative"]
                    if described.get("drafts") or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
            assert described["method"] == method and described["num_speculative_tokens"] == 4
            assert described["drafts"] > 0 and 0 < described["acceptance_rate"] <= 1
            assert described["reason"] and described["step_ms"]["plain"]  # the measured choice, with its costs
            accepted = [line for line in metrics.splitlines()
                        if line.startswith("vllm:spec_decode_num_accepted_tokens")]
            assert accepted and float(accepted[0].split()[-1]) > 0
            assert any(line.startswith("hetserve_worker_spec_decode_k") for line in metrics.splitlines())
        finally:
            spec.stop()
    assert not plain.orphans and not any(s.orphans for s in servers)


def test_mtp_without_an_mtp_head_is_refused_naming_what_is_accepted():
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--speculative", "mtp"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "`--speculative mtp` needs a checkpoint that ships an MTP head" in out.stderr
    assert "Accepted for it: auto, off, ngram, suffix" in out.stderr
    assert "Traceback" not in out.stderr
