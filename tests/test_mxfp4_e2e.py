"""End to end: a gpt-oss checkpoint with MXFP4 experts served on a simulated mixed host, over HTTP.

A real router with real workers on `sm_75,sm_90` serves a tiny gpt-oss (written by transformers)
whose experts the test packer put in MXFP4 (tests/mxfp4_checkpoints.py). Every worker becomes
ready and says in `/workers` what the checkpoint is (method, bits, scheme), how its device runs it
(dequantized at load, with the reason) and the bytes as stored and as widened; each answers
`/generate` when pinned to it, and in fp32 both give the same greedy text (the same reference
weights everywhere). `hetserve plan --model` sizes the experts as the workers hold them.
"""

from __future__ import annotations

import pytest

from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow

DEVICES = {"gpu0": "7.5", "gpu1": "9.0"}
PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.family_checkpoints import make_family_checkpoint
    from tests.mxfp4_checkpoints import mxfp4_checkpoint

    root = tmp_path_factory.mktemp("e2e-mxfp4")
    return mxfp4_checkpoint(make_family_checkpoint("gpt_oss", root / "src"), root / "mxfp4")


@pytest.fixture(scope="module")
def router(checkpoint):
    r = RouterProcess(
        ["--model", str(checkpoint), "--simulate", "sm_75,sm_90", "--dtype", "float32", "--max-batch", "4",
         "--canary-interval", "0"],
        fake=False,
        ready_timeout=400,
    )  # fmt: skip
    yield r
    r.stop()


def test_every_worker_serves_the_mxfp4_checkpoint_and_says_how(router):
    with router.client(timeout=30) as c:
        workers = {w["id"]: w for w in c.get("/workers").json()["workers"]}
    assert sorted(workers) == sorted(DEVICES)
    texts = set()
    for wid, cap in DEVICES.items():
        w = workers[wid]
        assert w["state"] == "ready" and w["device"]["capability"] == cap, wid
        q = w["fp8"]["checkpoint"]["quantization"]
        assert (q["method"], q["bits"], q["schemes"][0]["layout"]) == ("mxfp4", 4, "mxfp4"), wid
        assert q["execution"] == "dequantized" and "dequantized to the model dtype at load" in q["reason"], (
            wid
        )
        assert q["quantized_modules"] == 8 and 0 < q["stored_bytes"] < q["weight_bytes"], wid
        assert q["widened_bytes"] == q["weight_bytes"] - q["stored_bytes"], wid
        with router.client(timeout=120) as c:
            r = c.post("/generate", headers={"X-Hetserve-Worker": wid},
                       json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}})  # fmt: skip
        assert r.status_code == 200 and r.headers["X-Worker-Id"] == wid, r.text
        texts.add(r.json()["generated_text"])
    assert len(texts) == 1 and texts.pop()


def test_the_plan_names_the_mxfp4_execution_and_sizes_the_experts_widened(checkpoint):
    from server.commands.plan import _render, build_plan
    from workers.contract.model_size import read_profile

    plan = build_plan("sm_75,sm_90", model=str(checkpoint), dtype="bfloat16")
    assert plan["model"]["features"]["quantization"].startswith(
        "mxfp4 e2m1 with e8m0 scales per 32 dequantized ("
    )
    assert (
        "quantization mxfp4 e2m1 with e8m0 scales per 32 dequantized (every device: MXFP4 experts"
        in _render(plan)
    )
    profile = read_profile(checkpoint)
    for slot in plan["placement"]["devices"]:  # the experts at two bytes a weight, not their stored bytes
        assert slot["need"]["weight_bytes"] >= 2 * profile.mxfp4_params, slot
