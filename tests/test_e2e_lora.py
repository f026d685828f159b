"""End to end: `hetserve serve --lora NAME=DIR` over a real router and a real CPU worker.

A tiny llama checkpoint written by transformers and two adapters written by PEFT over it
(tests/lora_adapters.py): `/v1/models` lists each adapter with its base as `parent`; the OpenAI
`model` field (and `X-Hetserve-Model` on TGI's `/generate`) naming an adapter gives PEFT's greedy
tokens for that adapter, concurrent requests of both adapters and the base each get their own; an
unknown name is OpenAI's 404 `model_not_found`. At run time `/v1/load_lora_adapter` adds a third
(past `--max-loras 2`: the least recently used idle one leaves memory and is read again when asked
for) and `/v1/unload_lora_adapter` removes it, with the API key; a bad adapter is refused by name.
An adapter loaded at run time outlives its worker: killed, the worker's replacement serves it with
the same tokens, `/v1/models` still lists it, and `/workers` shows the replacement's pool bringing
an evicted adapter back from host memory rather than disk.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.family_checkpoints import make_family_checkpoint
from tests.lora_adapters import make_adapter, peft_model
from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

PROMPT = "Once upon a time there was a little fox who lived near the river, and every morning it went down"
NEW_TOKENS = 16
KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-e2e")
    base = make_family_checkpoint("llama", root / "base")
    dirs = {"coder": make_adapter(base, root / "coder", 1), "tone": make_adapter(base, root / "tone", 2, r=8,
                                                                                   rslora=True)}
    args = ["--model", f"tiny={base}", "--dtype", "float32", "--max-batch", "4", "--max-loras", "2", "--api-key", KEY,
            *[a for name, d in dirs.items() for a in ("--lora", f"{name}={d}")]]
    router = RouterProcess(args, fake=False, ready_timeout=300)
    yield base, dirs, router
    router.stop()
    assert not router.orphans, f"workers left running: {router.orphans}"


def _generate(c, model: str | None) -> tuple[list[int], list[int], str]:
    headers = {} if model is None else {"X-Hetserve-Model": model}
    r = c.post("/generate", headers=headers, json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": NEW_TOKENS, "details": True, "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    return [t["id"] for t in details["prefill"]], [t["id"] for t in details["tokens"]], r.json()["generated_text"]


def test_models_lists_each_adapter_with_its_base(served):
    _, dirs, router = served
    with router.client(headers=AUTH) as c:
        data = c.get("/v1/models").json()["data"]
    by_id = {m["id"]: m for m in data}
    assert list(by_id) == ["tiny", "coder", "tone"]
    for name, path in dirs.items():
        assert by_id[name]["parent"] == "tiny" and by_id[name]["root"] == str(path.resolve())


def test_the_model_field_picks_the_adapter_as_peft_computes_it(served):
    base, dirs, router = served
    with router.client(timeout=120, headers=AUTH) as c:
        runs = {name: _generate(c, name) for name in (None, "coder", "tone")}
        r = c.post("/v1/completions", json={"model": "coder", "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "coder"
    assert r.json()["choices"][0]["text"] == runs["coder"][2]
    prompt = runs[None][0]
    with torch.no_grad():
        for name in (None, "coder", "tone"):
            model = peft_model(base, None if name is None else dirs[name])
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                                 eos_token_id=model.generation_config.eos_token_id)
            assert runs[name][1] == out[0, len(prompt):].tolist(), name
    assert len({tuple(run[1]) for run in runs.values()}) == 3, "the adapters changed nothing"


def test_concurrent_requests_of_adapters_and_base_each_get_their_own(served):
    _, _, router = served
    names = [None, "coder", "tone"] * 3
    with router.client(timeout=120, headers=AUTH) as c:
        alone = {name: _generate(c, name)[1] for name in (None, "coder", "tone")}
        with ThreadPoolExecutor(len(names)) as pool:
            together = list(pool.map(lambda n: _generate(c, n)[1], names))
    assert together == [alone[n] for n in names]


def test_workers_and_metrics_show_each_workers_adapters(served):
    _, dirs, router = served
    with router.client(headers=AUTH) as c:
        _generate(c, "coder")
        c.get("/health")
        loras = c.get("/workers").json()["workers"][0]["loras"]
        text = c.get("/metrics").text
    assert loras["max_loras"] == 2
    assert {a["name"]: a["path"] for a in loras["adapters"]} == {n: str(p.resolve()) for n, p in dirs.items()}
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{")]
    assert any('worker_id="all"' in ln for ln in lines) and len(lines) == 2, lines  # the worker's and the pod's
    assert all('max_lora="2"' in ln and "running_lora_adapters=" in ln and "waiting_lora_adapters=" in ln
               for ln in lines)


def test_an_unknown_adapter_is_openais_404(served):
    _, _, router = served
    with router.client(headers=AUTH) as c:
        r = c.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "`nope`" in error["message"] and "coder, tone" in error["message"]


def test_adapters_load_and_unload_at_run_time(served, tmp_path):
    base, _, router = served
    late = make_adapter(base, tmp_path / "late", 3, r=2, targets=("q_proj", "down_proj"))
    wide = make_adapter(base, tmp_path / "wide", 4, r=32)
    with router.client() as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late)})
        assert r.status_code == 401, r.text  # control routes take the API key
    with router.client(timeout=120, headers=AUTH) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late)})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'late' added successfully.", r.text
        again = c.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late)})
        assert again.status_code == 400 and "already been loaded" in again.text
        bad = c.post("/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(wide)})
        assert bad.status_code == 422 and "rank `32`" in bad.text and "--max-lora-rank" in bad.text, bad.text
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "coder", "tone", "late"]
        prompt, got, _ = _generate(c, "late")
        runs = {name: _generate(c, name)[1] for name in ("coder", "tone", "late")}  # three adapters, two slots
        assert runs["late"] == got
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert r.status_code == 200, r.text
        gone = c.post("/v1/completions", json={"model": "late", "prompt": PROMPT, "max_tokens": 2})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    with torch.no_grad():
        model = peft_model(base, late)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             eos_token_id=model.generation_config.eos_token_id)
    assert got == out[0, len(prompt):].tolist()


def test_an_adapter_loaded_at_run_time_is_served_by_a_restarted_worker(served, tmp_path):
    """Guards `ctx.supervisor.runtime_loras[name] = path` (server/edge/routes/lora.py) and its use in
    `Supervisor._spawn`: without them the restarted worker knows only `--lora`'s adapters and the
    request for `kept` fails, while `/v1/models` still lists it."""
    base, _, router = served
    kept = make_adapter(base, tmp_path / "kept", 5, r=4, targets=("v_proj", "up_proj"))
    with router.client(timeout=120, headers=AUTH) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "kept", "lora_path": str(kept)})
        assert r.status_code == 200, r.text
        _, before, _ = _generate(c, "kept")
        victim = c.get("/workers").json()["workers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        back = router.wait_for(lambda: c.get("/health") and (w := c.get("/workers").json()["workers"][0])["state"]
                               == "ready" and w["pid"] != victim["pid"] and w["loras"] and w, 180, interval=0.5)
        assert "kept" in {a["name"] for a in back["loras"]["adapters"]}
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "coder", "tone", "kept"]
        _, after, _ = _generate(c, "kept")
        for name in ("coder", "tone", "kept", "coder"):  # three adapters over two slots
            _generate(c, name)
        # /workers shows each worker's last /health probe: wait for the one after these requests
        for _ in range(60):
            pool = c.get("/workers").json()["workers"][0]["loras"]["pool"]
            if pool["loads_from_host"] >= 1:
                break
            time.sleep(0.5)
    assert after == before
    assert pool["slots"] == 2 and pool["on_device"] == 2 and pool["loads_from_host"] >= 1, pool
    assert pool["loads_from_disk"] == 3, pool  # each adapter read once, at the worker's start
