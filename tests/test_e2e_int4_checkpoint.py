"""End to end: one 4-bit checkpoint served on a simulated mixed host, over HTTP.

A real router with real workers on `sm_70,sm_75,sm_86,sm_90,cpu` serves a tiny Llama (written by
transformers) packed in AWQ's GEMM format by the test packer (tests/int4_checkpoints.py). Every
worker becomes ready and says in `/workers` what the checkpoint is (method, format, schemes), how
its device runs it and why (sm_70: dequantized at load, the widened bytes shown; sm_75, sm_86 and
sm_90: the Triton W4A16 layer of its tuning, the packed bytes kept, at most 0.3x of bf16's; a CPU
worker: the packed torch layer, the same bytes), and the
kernel entry the status page lists says the same; each answers `/generate` when pinned to it, and in
fp32 all give the same greedy text (the same reference weights everywhere, within fp32 rounding).
"""

from __future__ import annotations

import pytest

from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow

DEVICES = {"gpu0": "7.0", "gpu1": "7.5", "gpu2": "8.6", "gpu3": "9.0", "cpu4": None}
# each device's execution and the kernel layer the mapping gives it
EXPECTED = {"gpu0": ("dequantized", "Int4CheckpointLinearDequantized"), "gpu1": ("w4a16", "Int4LinearTritonSm75"),
            "gpu2": ("w4a16", "Int4LinearTritonSm80"), "gpu3": ("w4a16", "Int4LinearTritonSm90"),
            "cpu4": ("packed", "Int4CheckpointLinear")}
PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    from tests.family_checkpoints import make_family_checkpoint
    from tests.int4_checkpoints import quantize_checkpoint

    root = tmp_path_factory.mktemp("e2e-int4")
    ckpt, _ = quantize_checkpoint(make_family_checkpoint("llama", root / "src"), root / "awq", "awq", 32)
    r = RouterProcess(["--model", str(ckpt), "--simulate", "sm_70,sm_75,sm_86,sm_90,cpu", "--dtype", "float32",
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
        execution, layer = EXPECTED[wid]
        kernel = w["kernels"]["Int4CheckpointLinear"]
        assert q["execution"] == execution and kernel["layer"] == layer, (wid, q, kernel)
        where = "CPU" if cap is None else f"sm_{cap.replace('.', '')}"
        assert kernel["variant"].split("-")[0] == execution and q["reason"].startswith(where), wid
        assert q["quantized_modules"] == 28, wid
        if execution == "dequantized":  # the widened bytes shown: fp32 weights, twice bf16's
            assert "below sm_75" in q["reason"] and "dequantized at load" in q["reason"], wid
            assert q["widened_bytes"] == q["weight_bytes"] - q["stored_bytes"] > 0 and q["bf16_ratio"] == 2.0, wid
            assert q["packed_modules"] == 0 and q["widened_modules"] == 16, wid
        else:  # the packed bytes kept: a 4-bit kernel runs (the CPU: its packed torch layer)
            assert (("W4A16" if cap else "packed") in q["reason"] and q["packed_modules"] == 16
                    and q["widened_modules"] == 0), wid
            assert q["bf16_ratio"] <= 0.3 and q["weight_bytes"] < 1.1 * q["stored_bytes"], wid
        with router.client(timeout=120) as c:
            r = c.post("/generate", headers={"X-Hetserve-Worker": wid},
                       json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}})  # fmt: skip
        assert r.status_code == 200 and r.headers["X-Worker-Id"] == wid, r.text
        texts.add(r.json()["generated_text"])
    assert len(texts) == 1 and texts.pop()


def test_the_status_page_says_each_devices_4bit_execution(router):
    """In a real browser, each worker's card lists its `Int4CheckpointLinear` kernel: the variant (its
    first word the execution) and why."""
    from tests.router_harness import CHROMIUM_FLAGS, chromium_path

    executable = chromium_path()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (dev extras)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto(router.url + "/")
            shown = {}
            for wid in DEVICES:
                item = page.locator(f".card[data-worker={wid}] li", has_text="Int4CheckpointLinear")
                sync_api.expect(item).to_have_count(1, timeout=20_000)
                shown[wid] = item.text_content()
        finally:
            browser.close()
    for wid, text in shown.items():
        execution, layer = EXPECTED[wid]
        assert f"kernels_local/int4_linear / {execution}" in text, (wid, text)
        assert ("below sm_75" in text) == (execution == "dequantized"), (wid, text)
        assert ("Triton W4A16" in text) == (execution == "w4a16") and ("kept packed" in text) == (execution == "packed")
