"""End to end: a model larger than every simulated device, served by `hetserve serve` as a pipeline.

transformers' tiny Gemma 3 (sliding and full layers, an embedding larger than its layers) in
fp32 takes about 3 MiB; on `--simulate sm_75:1.5MiB,sm_86:1.5MiB,sm_90:1.5MiB` no device holds
it and no two do, so `--pipeline auto` splits it over all three: the router starts the first
stage, which starts the others. Its greedy tokens over HTTP equal transformers' `generate`;
`/workers` shows one replica whose three stages each hold only their layers on their own
device; `kill -9` of the middle stage mid-stream ends that stream with a clear error (no other
replica to move to) and the whole pipeline comes back.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.router_harness import RouterProcess, alive

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

SIMULATE = "sm_75:1.5MiB,sm_86:1.5MiB,sm_90:1.5MiB"
PROMPT = "Once upon a time there was a little fox who lived near the river, and every morning it went down"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_family_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"))
    router = RouterProcess(["--simulate", SIMULATE, "--model", str(path), "--dtype", "float32", "--max-batch", "4"],
                           env={"HETSERVE_COMPILE": "off"}, fake=False, ready_timeout=300)
    stages: list[int] = []
    try:
        yield path, router, stages
    finally:
        router.stop()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(p) for p in stages):
            time.sleep(0.1)
        assert not router.orphans and not [p for p in stages if alive(p)], "workers left running"


def _pipeline(router) -> dict:
    (worker,) = router.workers()
    return worker


def test_the_model_fits_no_device_and_serves_as_three_stages(served):
    path, router, stages = served
    worker = _pipeline(router)
    assert worker["state"] == "ready" and worker["id"] == "gpu0"
    pipe = worker["pipeline"]["stages"]
    stages.extend(s["pid"] for s in pipe)
    assert [s["device"]["capability"] for s in pipe] == ["7.5", "8.6", "9.0"]
    assert pipe[0]["layers"][0] == 0 and pipe[-1]["layers"][1] == 4
    assert all(a["layers"][1] == b["layers"][0] for a, b in zip(pipe, pipe[1:], strict=False))
    usable = 1.5 * 2**20 * 0.9
    total = sum(s["weights_bytes"] for s in pipe)
    assert total > usable and all(s["weights_bytes"] <= usable for s in pipe)  # each holds its share only
    assert pipe[1]["kernels"]["RMSNorm"]["reason"].startswith("sm_86")


def test_the_status_page_shows_each_stage(served):
    """In a real browser, the pipeline's card lists its three stages: device, layers, bytes, fp8."""
    from tests.router_harness import CHROMIUM_FLAGS, chromium_path

    executable = chromium_path()
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (dev extras)")
    _, router, _ = served
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto(router.url + "/")
            card = page.locator(".card[data-worker=gpu0]")
            sync_api.expect(card.locator("dd.pipeline")).to_have_attribute("data-stages", "3", timeout=20_000)
            lines = card.locator("dd.pipeline .stage").all_inner_texts()
        finally:
            browser.close()
    assert [line.split(" (")[0] for line in lines] == ["stage 0: sm_75", "stage 1: sm_86", "stage 2: sm_90"], lines
    assert all(" · layers " in line and " weights · fp8 not used (float32)" in line for line in lines), lines


def test_greedy_tokens_over_http_equal_transformers(served):
    path, router, _ = served
    with router.client(timeout=120) as c:
        r = c.post("/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": 24, "details": True, "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    prompt, got = [t["id"] for t in details["prefill"]], [t["id"] for t in details["tokens"]]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                           eos_token_id=ref.generation_config.eos_token_id)
    assert len(prompt) > 16 and got == out[0, len(prompt):].tolist()  # longer than the sliding window


def test_killing_the_middle_stage_ends_the_stream_clearly_and_the_pipeline_comes_back(served):
    path, router, stages = served
    before = _pipeline(router)
    middle = before["pipeline"]["stages"][1]["pid"]
    lines = []
    with router.client(timeout=120) as c, c.stream("POST", "/generate_stream", json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 400}}) as stream:
        for line in stream.iter_lines():  # the kill lands mid-stream: after its first token, however fast
            lines.append(line)
            if len(lines) == 1:
                os.kill(middle, signal.SIGKILL)
    text = "\n".join(lines)
    assert "error" in text.splitlines()[-1] or "error" in text, text[-500:]
    back = router.wait_for(lambda: (w := _pipeline(router))["state"] == "ready" and w["restarts"] >= 1 and w, 180)
    assert back["pid"] != before["pid"] and back["pipeline"]["stages"][1]["pid"] != middle
    stages.extend(s["pid"] for s in back["pipeline"]["stages"])
    with router.client(timeout=120) as c:
        assert c.post("/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}}).status_code == 200
    assert not alive(middle)


def test_streams_on_a_killed_pipeline_move_to_the_other_replica(tmp_path):
    """A pipeline replica (gpu0+gpu1) beside a single-device one (gpu2), `--place six=gpu0+gpu1,gpu2`:
    kill -9 of the pipeline's second stage mid-stream moves its streams to gpu2, and every
    stream ends with all its tokens; the pipeline then comes back."""
    from tests.checkpoints import make_checkpoint
    from tests.router_harness import sse_events

    model = make_checkpoint(tmp_path / "six", num_hidden_layers=6)
    router = RouterProcess(["--simulate", "sm_80,sm_86,sm_90", "--model", f"six={model}", "--place",
                            "six=gpu0+gpu1,gpu2", "--dtype", "float32", "--max-batch", "8", "--canary-interval", "0"],
                           env={"HETSERVE_COMPILE": "off", "HETSERVE_SLOWDOWN": "gpu1=20,gpu2=20"},  # streams last
                           fake=False, ready_timeout=300)
    try:
        workers = {w["id"]: w for w in router.workers()}
        assert set(workers) == {"gpu0", "gpu2"} and workers["gpu2"]["pipeline"] is None
        second = workers["gpu0"]["pipeline"]["stages"][1]
        assert second["device"]["capability"] == "8.6"
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 200, "ignore_eos": True}}
        with router.client(timeout=180) as c, ThreadPoolExecutor(6) as pool:
            streams = [pool.submit(lambda: c.post("/generate_stream", json=body).text) for _ in range(6)]
            time.sleep(1.0)
            os.kill(second["pid"], signal.SIGKILL)
            finals = [sse_events(s.result(120))[-1] for s in streams]
        assert all(f.get("details", {}).get("generated_tokens") == 200 for f in finals), finals
        assert any(f["details"].get("migrations", 0) >= 1 for f in finals), finals
        back = router.wait_for(lambda: (w := router.worker("gpu0"))["state"] == "ready" and w["restarts"] >= 1
                               and w, 180)
        assert back["pipeline"]["stages"][1]["pid"] != second["pid"]
    finally:
        router.stop()
