"""End to end: a gpt-oss checkpoint with MXFP4 experts served on a simulated mixed host, over HTTP.

A real router with real workers on `sm_75,sm_90` serves a tiny gpt-oss (written by transformers)
whose experts the test packer put in MXFP4 (tests/mxfp4_checkpoints.py). Every worker becomes
ready and says in `/workers` what the checkpoint is (method, bits, scheme), how its device runs it
(sm_75 dequantizes the experts at load, sm_90 keeps them packed for the Triton grouped GEMM, whose
torch path a simulated device runs), with the reason and the bytes as stored, held and widened; each
answers `/generate` when pinned to it, and in fp32 both give the same greedy text (the same reference
weights everywhere). `hetserve plan --model` names each device's execution and sizes the experts as
each worker holds them.
"""

from __future__ import annotations

import pytest

from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow

DEVICES = {"gpu0": "7.5", "gpu1": "9.0"}
EXECUTIONS = {"gpu0": "dequantized", "gpu1": "w4a16"}  # the MXFP4 rule: packed from sm_80
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
        assert q["execution"] == EXECUTIONS[wid] and q["quantized_modules"] == 8, wid
        if q["execution"] == "dequantized":  # sm_75: widened at load, the experts in the model dtype
            assert "dequantized to the model dtype at load" in q["reason"], wid
            assert 0 < q["stored_bytes"] < q["weight_bytes"] and q["widened_bytes"] > 0, wid
        else:  # sm_90: kept packed for the Triton grouped GEMM
            assert q["reason"].startswith("sm_90: MXFP4 experts kept packed"), wid
            assert q["weight_bytes"] == q["stored_bytes"] > 0 and q["widened_bytes"] == 0, wid
        assert q["widened_bytes"] == q["weight_bytes"] - q["stored_bytes"], wid
        assert w["kernels"]["Mxfp4FusedMoE"]["variant"].startswith(EXECUTIONS[wid]), wid
        with router.client(timeout=120) as c:
            r = c.post("/generate", headers={"X-Hetserve-Worker": wid},
                       json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}})  # fmt: skip
        assert r.status_code == 200 and r.headers["X-Worker-Id"] == wid, r.text
        texts.add(r.json()["generated_text"])
    assert len(texts) == 1 and texts.pop()  # packed or widened, the same reference weights


def test_the_plan_names_each_devices_mxfp4_execution_and_sizes_its_experts(checkpoint):
    from server.commands.plan import _render, build_plan
    from workers.contract.model_size import read_profile

    plan = build_plan("sm_75,sm_90", model=str(checkpoint), dtype="bfloat16")
    feature = plan["model"]["features"]["quantization"]
    assert feature.startswith(
        "mxfp4 e2m1 with e8m0 scales per 32 per device (MXFP4 experts kept packed on CUDA"
    )
    text = _render(plan)
    assert "quantization mxfp4 e2m1 with e8m0 scales per 32 per device" in text
    variants = [d["kernels"]["Mxfp4FusedMoE"]["variant"] for d in plan["devices"]]
    assert variants == ["dequantized-torch", "w4a16-triton-sm90"]
    assert "sm_90: Hopper (sm_90): MXFP4 experts kept packed" in text
    profile = read_profile(checkpoint)
    t4, h100 = (slot["need"]["weight_bytes"] for slot in plan["placement"]["devices"])
    assert t4 >= 2 * profile.mxfp4_params  # the experts at two bytes a weight on sm_75 (float16)
    assert t4 - h100 == 2 * profile.mxfp4_params - profile.mxfp4_bytes  # stored bytes on sm_90
