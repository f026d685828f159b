"""End to end: one pre-quantized fp8 checkpoint served on a simulated mixed host, each worker in its own
execution, over HTTP.

Two real routers with real workers start side by side: the embedded model in the block-wise
`quant_method: fp8` format (tests/fp8_checkpoints.py) on `sm_75,sm_80,sm_89,sm_90,gfx942` (every
execution: dequantized, weight-only, native, native in e4m3fnuz), and a tiny Qwen3-MoE quantized by
compressed-tensors' compressor (fp8 experts in the fused MoE layer) on `sm_80,sm_90`. Each worker
says in `/workers` which execution it runs, with its kernel and reason, and the bytes its weights take;
each answers `/generate` when pinned to it (`X-Hetserve-Worker`); where compute is dequantized
(sm_75, and the weight-only sm_80 whose CPU path dequantizes too) the greedy texts are identical.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow
pytest.importorskip("compressed_tensors")

DENSE = {"gpu0": ("7.5", "dequantized"), "gpu1": ("8.0", "weight_only"), "gpu2": ("8.9", "native"),
         "gpu3": ("9.0", "native"), "gpu4": ("9.4", "native")}  # fmt: skip
MOE = {"gpu0": ("8.0", "weight_only"), "gpu1": ("9.0", "native")}
PROMPT = "Once upon a time, in a small village by the sea,"


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    from tests.family_checkpoints import make_family_checkpoint
    from tests.fp8_checkpoints import block_fp8_checkpoint, quantize_checkpoint

    root = tmp_path_factory.mktemp("e2e-fp8")
    dense = block_fp8_checkpoint(root / "dense")
    moe = quantize_checkpoint(make_family_checkpoint("qwen3_moe", root / "moe-src"), root / "moe", "compressed-tensors")
    specs = {"dense": (dense, "sm_75,sm_80,sm_89,sm_90,gfx942"), "moe": (moe, "sm_80,sm_90")}

    def start(name):
        ckpt, sim = specs[name]
        return RouterProcess(["--model", str(ckpt), "--simulate", sim, "--max-batch", "4", "--canary-interval", "0"],
                             fake=False, ready_timeout=400)  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(start, name) for name in specs}
        started = {}
        try:
            started = {name: f.result() for name, f in futures.items()}
        finally:
            if len(started) != len(futures):
                for f in futures.values():
                    if f.exception() is None:
                        f.result().stop()
    yield started
    for r in started.values():
        r.stop()


def _generate(router, worker: str):
    with router.client(timeout=120) as c:
        r = c.post("/generate", headers={"X-Hetserve-Worker": worker},
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": 16}})  # fmt: skip
        assert r.status_code == 200, r.text
        return r.json()["generated_text"], r.headers


@pytest.mark.parametrize("name,expected", [("dense", DENSE), ("moe", MOE)])
def test_every_worker_runs_the_checkpoint_its_own_way_and_says_why(routers, name, expected):
    with routers[name].client(timeout=30) as c:
        workers = {w["id"]: w for w in c.get("/workers").json()["workers"]}
    assert sorted(workers) == sorted(expected)
    for wid, (cap, execution) in expected.items():
        w = workers[wid]
        ckpt = w["fp8"]["checkpoint"]
        assert w["state"] == "ready" and w["device"]["capability"] == cap, wid
        assert ckpt["execution"] == execution and execution in ckpt["kernel"]["variant"], wid
        assert ckpt["reason"] and ckpt["kernel"]["reason"], wid
        # the fp8 layers run, so the labels name them (workers/engine/describe.py `fp8_description`)
        assert w["fp8"]["used"] is True, wid
        assert w["fp8"]["label"] == f"{w['fp8']['convention']} (checkpoint, {execution})", wid
        assert ckpt["fmt"] == ("e4m3fnuz" if cap == "9.4" else "e4m3fn"), wid
        if execution == "dequantized":  # the device widens the weights, and says by how much
            assert ckpt["widened_bytes"] > 0 and ckpt["weight_bytes"] > ckpt["stored_bytes"], wid
        else:
            assert ckpt["widened_bytes"] == 0 and ckpt["weight_bytes"] == ckpt["stored_bytes"], wid
        assert ckpt["quantization"]["method"] == ("fp8" if name == "dense" else "compressed-tensors"), wid
        if name == "moe":  # the experts in the fused MoE layer, with their own kernel
            assert ckpt["expert_layers"] == 3 and ckpt["expert_kernel"]["layer"].startswith("Fp8FusedMoE"), wid
            assert execution in ckpt["expert_kernel"]["variant"], wid


@pytest.mark.parametrize("name,expected", [("dense", DENSE), ("moe", MOE)])
def test_every_worker_answers_and_dequantized_compute_agrees(routers, name, expected):
    texts = {}
    for wid, (cap, execution) in expected.items():
        text, headers = _generate(routers[name], wid)
        assert headers["x-worker-id"] == wid and headers["x-worker-capability"] == cap
        assert headers["x-fp8-convention"].endswith(f"(checkpoint, {execution})"), headers["x-fp8-convention"]
        assert text.strip(), wid
        texts[wid] = text
    if name == "dense":
        assert texts["gpu0"] == texts["gpu1"]  # dequantized (sm_75) and weight-only (sm_80): the same values
