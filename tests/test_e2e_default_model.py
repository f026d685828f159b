"""End to end with what users run first: `hetserve serve` without `--model` (the embedded
model), fp8-quantized, on a simulated sm_80 + sm_90 host: each worker answers in its own fp8
convention (emulated on sm_80, native e4m3 on sm_90) through the public API."""

from __future__ import annotations

import pytest

from tests.router_harness import RouterProcess
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]


@pytest.fixture(scope="module")
def router():
    r = RouterProcess(["--simulate", "sm_80,sm_90", "--quantize", "fp8"], fake=False, ready_timeout=240)
    yield r
    r.stop()
    assert not r.orphans


def test_embedded_model_serves_on_both_fp8_conventions(router):
    with router.client(timeout=120) as c:
        workers = {w["id"]: w for w in c.get("/workers").json()["workers"]}
        assert {w: workers[w]["fp8"]["convention"] for w in workers} == {"gpu0": "emulated", "gpu1": "native_e4m3"}
        # --quantize fp8: the projections compute in each device's convention, and the labels say it
        assert {w: (workers[w]["fp8"]["used"], workers[w]["fp8"]["label"]) for w in workers} == {
            "gpu0": (True, "emulated"), "gpu1": (True, "native_e4m3")}
        assert c.get("/v1/models").json()["data"][0]["id"]
        for wid, convention in (("gpu0", "emulated"), ("gpu1", "native_e4m3")):
            r = c.post("/v1/chat/completions", headers={"X-Hetserve-Worker": wid},
                       json={"messages": [{"role": "user", "content": "Tell me a fortune"}], "max_tokens": 12})
            assert r.status_code == 200, r.text
            assert (r.headers["x-worker-id"], r.headers["x-fp8-convention"]) == (wid, convention)
            body = r.json()
            assert body["usage"]["completion_tokens"] >= 1 and body["choices"][0]["message"]["content"].strip()
            r = c.post("/generate", headers={"X-Hetserve-Fp8": convention},
                       json={"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8, "details": True}})
            assert r.status_code == 200 and r.headers["x-worker-id"] == wid
            assert r.json()["details"]["generated_tokens"] >= 1
