"""End to end: one 4-bit checkpoint served on a simulated mixed host, over HTTP.

A real router with real workers on `sm_70,sm_75,sm_86,sm_90` serves a tiny Llama (written by
transformers) packed in AWQ's GEMM format by the test packer (tests/int4_checkpoints.py). Every
worker becomes ready, says in `/workers` what the checkpoint is (method, format, schemes), how it
runs (dequantized at load, with the reason) and the bytes as stored and as widened; each answers `/generate` when pinned to it, and in fp32 all give the same greedy text (the
same reference weights everywhere).
"""

from __future__ import annotations

import pytest

from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow

DEVICES = {"gpu0": "7.0", "gpu1": "7.5", "gpu2": "8.6", "gpu3": "9.0"}
PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    from tests.family_checkpoints import make_family_checkpoint
    from tests.int4_checkpoints import quantize_checkpoint

    root = tmp_path_factory.mktemp("e2e-int4")
    ckpt, _ = quantize_checkpoint(make_family_checkpoint("llama", root / "src"), root / "awq", "awq", 32)
    r = RouterProcess(["--model", str(ckpt), "--simulate", "sm_70,sm_75,sm_86,sm_90", "--dtype", "float32",
                       "--max-batch", "4", "--canary-interval", "0"], fake=False, ready_timeout=400)  # fmt: skip
    yield r
    r.stop()


def test_every_worker_serves_the_4bit_checkpoint_and_says_how(router):
    with router.client(timeout=30) as c:
        workers = {w["id"]: w for w in c.get("/workers").json()["workers"]}
    assert sorted(workers) == sorted(DEVICES)
    texts = set()
    for wid, cap in DEVICES.items():
        w = workers[wid]
        assert w["state"] == "ready" and w["device"]["capability"] == cap, wid
        q = w["fp8"]["checkpoint"]["quantization"]
        assert (q["method"], q["format"], q["bits"]) == ("awq", "gemm", 4), wid
        assert q["execution"] == "dequantized" and "dequantized at load" in q["reason"], wid
        assert q["quantized_modules"] == 28 and 0 < q["stored_bytes"] < q["weight_bytes"], wid
        assert q["widened_bytes"] == q["weight_bytes"] - q["stored_bytes"], wid
        with router.client(timeout=120) as c:
            r = c.post("/generate", headers={"X-Hetserve-Worker": wid},
                       json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}})  # fmt: skip
        assert r.status_code == 200 and r.headers["X-Worker-Id"] == wid, r.text
        texts.add(r.json()["generated_text"])
    assert len(texts) == 1 and texts.pop()
