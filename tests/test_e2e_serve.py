"""End to end: `hetserve serve --simulate sm_80,sm_89,sm_90` with real worker processes.

One router for the whole module, serving a tiny random checkpoint (tests/checkpoints.py)
through three real workers (`python -m workers`): per-device fp8 conventions in /workers,
balancing, the `openai` and `huggingface_hub` clients unchanged, no 5xx under schema
fuzzing (schemathesis), and `kill -9` of a worker under load (last: it restarts a worker).
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.router_harness import RouterProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path_factory.mktemp("e2e") / "tiny")
    r = RouterProcess(["--simulate", "sm_80,sm_89,sm_90", "--model", str(model), "--max-batch", "8"],
                      fake=False, ready_timeout=240)
    yield r
    r.stop()
    assert not r.orphans, f"workers left running: {r.orphans}"


@pytest.fixture(scope="module")
def client(router):
    with router.client(timeout=120) as c:
        yield c


def _events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and "[DONE]" not in line]


def test_workers_are_ready_with_their_own_fp8_convention_and_kernels(client):
    workers = client.get("/workers").json()["workers"]
    assert [(w["id"], w["state"]) for w in workers] == [("gpu0", "ready"), ("gpu1", "ready"), ("gpu2", "ready")]
    assert [w["device"]["capability"] for w in workers] == ["8.0", "8.9", "9.0"]
    assert [w["fp8"]["convention"] for w in workers] == ["emulated", "native_e4m3", "native_e4m3"]
    # without --quantize fp8 no layer computes in fp8 (server/fleet/handle.py `fp8_entry`): each says
    # so, and the convention stays the device's capability
    assert [(w["fp8"]["used"], w["fp8"]["label"]) for w in workers] == [(False, "not used (float32)")] * 3
    assert [w["device"]["fp8"]["convention"] for w in workers] == ["emulated", "native_e4m3", "native_e4m3"]
    assert all("no `--quantize fp8`" in w["fp8"]["used_reason"] for w in workers)
    for w in workers:
        assert w["device"]["simulated"] is True and w["restarts"] == 0 and w["pid"] > 0
        assert w["fp8"]["reason"] and w["kernels"], w
        for choice in w["kernels"].values():
            assert set(choice) >= {"repo", "layer", "variant", "reason"}
    assert client.get("/health").json()["status"] == "ok"


def test_generate_and_stream_carry_the_worker_headers(client):
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 5, "details": True}})
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] <= 5
    assert {"x-worker-id", "x-worker-capability", "x-fp8-convention"} <= set(r.headers)
    r = client.post("/generate_stream", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    events = _events(r.text)
    assert r.status_code == 200 and events[-1]["details"]["generated_tokens"] == len(events)
    assert events[-1]["generated_text"] is not None


def test_requests_spread_over_the_three_workers(client):
    def one(_):
        r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 8}})
        assert r.status_code == 200, r.text
        return r.headers["x-worker-id"], r.headers["x-fp8-convention"]

    with ThreadPoolExecutor(6) as pool:
        seen = set(pool.map(one, range(18)))
    assert {w for w, _ in seen} == {"gpu0", "gpu1", "gpu2"}
    assert dict(seen) == {"gpu0": "not used (float32)", "gpu1": "not used (float32)", "gpu2": "not used (float32)"}


def test_the_fp8_filter_still_picks_by_the_devices_convention(client):
    """Guards server/routing/filter.py's `X-Hetserve-Fp8` match on `WorkerHandle.fp8_convention` (the
    device's convention) now that the headers show `not used (float32)`: sm_80 is the only emulated one."""
    for _ in range(3):
        r = client.post("/generate", headers={"X-Hetserve-Fp8": "emulated"},
                        json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.headers["x-worker-id"] == "gpu0", r.text


def test_greedy_text_is_the_same_on_every_worker(client):
    """Same prompt, greedy, fp8 off: each device runs its own kernels yet answers the same text."""
    texts = {}
    for wid in ("gpu0", "gpu1", "gpu2"):
        r = client.post("/generate", json={"inputs": "The quick", "parameters": {"max_new_tokens": 6}},
                        headers={"X-Hetserve-Worker": wid})
        assert r.headers["x-worker-id"] == wid
        texts[wid] = r.json()["generated_text"]
    assert len(set(texts.values())) == 1, texts


def test_metrics_carry_every_worker_series_with_id_and_capability(client):
    from prometheus_client.parser import text_string_to_metric_families

    client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    families = list(text_string_to_metric_families(client.get("/metrics").text))
    fleet_wide = ("hetserve_router_requests", "hetserve_router_request_duration", "hetserve_router_chars_per_token",
                  "hetserve_router_sessions", "hetserve_router_model_",  # per model, not per worker
                  "hetserve_router_client_",  # the relay's writes to clients (server/dispatch/buffers.py)
                  "hetserve_router_responses_")  # the Responses store the router holds (server/protocol/responses/)
    worker_samples = [s for f in families if not f.name.startswith(fleet_wide) for s in f.samples]
    assert worker_samples
    labels = {(s.labels.get("worker_id"), s.labels.get("capability"), s.labels.get("model")) for s in worker_samples}
    # the inference gateways' gauges also carry the pod's total, labelled `all`
    assert labels == {("gpu0", "8.0", "tiny"), ("gpu1", "8.9", "tiny"), ("gpu2", "9.0", "tiny"),
                      ("all", "all", "all")}, labels
    pod = {f.name for f in families for s in f.samples if s.labels.get("worker_id") == "all"}
    assert pod == {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                   "vllm:gpu_cache_usage_perc", "vllm:lora_requests_info"}, pod  # the last: LoRA affinity
    own = {f.name for f in families if not f.name.startswith("hetserve_router_")}
    assert own, "no series scraped from the workers"


def test_turns_of_a_conversation_land_on_the_worker_holding_its_prefix(router, client):
    """Cache-aware routing (the default) with real workers: every turn, resending the whole
    history, goes where the history is (`X-Hetserve-Route: prefix:<tokens>`), and that worker's
    own prefix cache counts the hits."""
    hits = "hetserve_worker_prefix_cache_hits_tokens_total"
    before = {w: router.metric(hits, worker_id=w) or 0.0 for w in ("gpu0", "gpu1", "gpu2")}
    messages = [{"role": "system", "content": "Answer about this text. " + " ".join(
        f"Part {n}: the river turns {n} times." for n in range(4))}]
    homes, routes, prompts = [], [], []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Part {turn}?"})
        r = client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 4,
                                                      "temperature": 0})
        assert r.status_code == 200, r.text
        homes.append(r.headers["x-worker-id"])
        routes.append(r.headers["x-hetserve-route"])
        prompts.append(r.json()["usage"]["prompt_tokens"])
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    assert len(set(homes)) == 1, (homes, routes)
    assert all(route.startswith("prefix:") and int(route.split(":")[1]) > 0 for route in routes[1:]), routes
    home = homes[0]
    after = {w: router.metric(hits, worker_id=w) or 0.0 for w in before}
    # Each later turn found most of the turn before it cached (whole blocks of it).
    assert after[home] - before[home] >= 0.6 * sum(prompts[:-1]), (before, after, prompts)
    assert all(after[w] == before[w] for w in before if w != home), (before, after)
    routing = router.worker(home)["routing"]
    assert routing["prefix_chunks"] > 0 and routing["decisions"].get("prefix", 0) >= 3, routing
    decisions = router.metric("hetserve_router_route_decisions_total", worker_id=home, reason="prefix")
    assert decisions is not None and decisions >= 3


def test_openai_client_unchanged(router):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    model = c.models.list().data[0].id
    done = c.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    assert done.usage.prompt_tokens > 0 and 0 < done.usage.completion_tokens <= 4
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.choices[0].message.role == "assistant" and chat.usage.prompt_tokens > 5  # the template's tokens
    chunks = list(c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("length", "stop")
    many = c.completions.create(model=model, prompt=["a", "b"], n=2, max_tokens=2, seed=1)
    assert [ch.index for ch in many.choices] == [0, 1, 2, 3]


def test_huggingface_inference_client_unchanged(router):
    hub = pytest.importorskip("huggingface_hub")
    c = hub.InferenceClient(model=router.url)
    text = c.text_generation("Hello", max_new_tokens=4)
    assert isinstance(text, str)
    out = c.text_generation("Hello", max_new_tokens=4, details=True, seed=3, do_sample=True)
    assert 1 <= out.details.generated_tokens <= 4
    streamed = list(c.text_generation("Hello", max_new_tokens=3, stream=True, details=True))
    assert streamed[-1].details is not None and streamed[-1].generated_text is not None


def test_schema_fuzzing_finds_no_server_error(router):
    """Every operation of /openapi.json, 25 generated requests each: no answer is a 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{router.url}/openapi.json")
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(base_url=router.url, timeout=60)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.status_code, response.text[:300]))

        fuzz()
    assert not failures, sorted({(m, p, code, text) for m, p, _, code, text in failures})
    with router.client() as c:
        assert c.get("/health").json()["status"] == "ok"  # the fuzzing crashed no worker


def test_kill_9_under_load_loses_no_request_and_the_worker_comes_back(router, client):
    victim = next(w for w in client.get("/workers").json()["workers"] if w["id"] == "gpu1")
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 40, "details": True}}

    def one(_):
        r = client.post("/generate", json=body)
        return r.status_code, r.json()

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(one, i) for i in range(36)]
        time.sleep(0.5)
        os.kill(victim["pid"], signal.SIGKILL)
        health = router.wait_for(lambda: (h := client.get("/health").json())["status"] == "degraded" and h, 15)
        results = [f.result() for f in futures]
    assert health["workers"]["gpu1"] in ("unhealthy", "restarting", "starting")
    for code, payload in results:  # a result, or at least a clear error
        assert code == 200 or (code in (429, 503) and payload.get("error")), (code, payload)
    assert sum(code == 200 for code, _ in results) == len(results), results
    back = router.wait_for(lambda: (w := next(x for x in client.get("/workers").json()["workers"]
                                              if x["id"] == "gpu1"))["state"] == "ready" and w, 120)
    assert back["restarts"] == 1 and back["pid"] != victim["pid"]
    assert back["fp8"]["convention"] == "native_e4m3"
    assert client.get("/health").json()["status"] == "ok"
