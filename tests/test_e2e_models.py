"""End to end: several models on one host, each on the devices its placement gives it.

1. Two tiny real checkpoints on three simulated devices whose memory only the larger model's
   placement can satisfy one way (`big` on the 2 MiB devices, `small` on the 1 MiB one),
   through the real `openai` client: each request is answered by its own model's worker with
   the same greedy text as a router serving that model alone.
2. Stand-in workers (tests/router_fake_worker.py), three models and `--max-loaded-models 2`:
   requests for all three at once load and unload models on demand and none is lost (each is
   answered by its model, or is a 503 with `Retry-After`); the loads show in /workers, /stats
   and /metrics; `POST /models/{name}/load|unload` need the API key; a pinned model stays.
   Each worker's placement (role, reason, bytes) is in /workers, and a freed device says why.
3. Stand-in workers, two models pinned apart: a stream whose worker dies mid-way moves to the
   other worker of its model, never to the other model's.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.inprocess_router import inprocess_router
from tests.router_harness import RouterProcess, metric_value
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.slow

PROMPTS = ("Hello, world!", "The quick brown fox", "Once upon a time")


def _start_all(specs: dict[str, tuple[list[str], dict]]) -> dict[str, RouterProcess]:
    """Start several routers at once (their workers load side by side)."""
    out: dict[str, RouterProcess] = {}
    errors: list[BaseException] = []

    def start(name, args, kw):
        try:
            out[name] = RouterProcess(args, **kw)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(n, a, kw)) for n, (a, kw) in specs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for r in out.values():
            r.stop()
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("models")
    big = make_checkpoint(root / "big", seed=1, hidden_size=128, intermediate_size=256, head_dim=32)
    small = make_checkpoint(root / "small", seed=2)
    real = {"fake": False, "ready_timeout": 240}
    r = _start_all({
        "both": (["--simulate", "sm_80:1MiB,sm_89:2MiB,sm_90:2MiB", "--model", f"big={big}", "--model",
                  f"small={small}", "--max-batch", "4"], real),
        "big": (["--simulate", "sm_90", "--model", f"big={big}", "--max-batch", "4"], real),
        "small": (["--simulate", "sm_80", "--model", f"small={small}", "--max-batch", "4"], real),
    })
    yield r
    for router in r.values():
        router.stop()
        assert not router.orphans


def test_each_model_is_placed_where_its_bytes_fit(routers):
    workers = {w["id"]: w for w in routers["both"].workers()}
    assert {i: w["model"]["name"] for i, w in workers.items()} == {"gpu0": "small", "gpu1": "big", "gpu2": "big"}
    assert all(w["state"] == "ready" for w in workers.values())
    # each worker says why its device serves its model, with the bytes it needs there
    placed = {i: w["placement"] for i, w in workers.items()}
    assert {i: p["role"] for i, p in placed.items()} == {"gpu0": "first", "gpu1": "first", "gpu2": "replica"}
    assert "smallest free device that holds small" in placed["gpu0"]["reason"]
    assert placed["gpu2"]["reason"].startswith("replica 2 of big")
    assert 0 < placed["gpu1"]["need_bytes"] <= placed["gpu1"]["usable_bytes"] < 2 * 2**20
    assert placed["gpu0"]["need_bytes"] < placed["gpu1"]["need_bytes"]
    status = httpx.get(routers["both"].url + "/workers").json()
    assert [(p["worker_id"], p["model"]) for p in status["placement"]] == [("gpu0", "small"), ("gpu1", "big"),
                                                                          ("gpu2", "big")]
    models = {m["id"]: m for m in httpx.get(routers["both"].url + "/v1/models").json()["data"]}
    assert list(models) == ["big", "small"]
    assert [p["worker_id"] for p in models["big"]["placement"]] == ["gpu1", "gpu2"]
    assert "smallest free device that holds small" in models["small"]["placement"][0]["reason"]
    assert models["small"]["context_length"] == 256 and models["small"]["architecture"] == "llama"
    assert models["big"]["state"] == "loaded" and models["big"]["quantization"] is None


def test_each_request_is_answered_by_its_models_worker_as_that_model_alone_answers(routers):
    openai = pytest.importorskip("openai")
    both = openai.OpenAI(base_url=routers["both"].url + "/v1", api_key="-", max_retries=0)
    place = {"big": {"gpu1", "gpu2"}, "small": {"gpu0"}}
    texts = {}
    for name in ("big", "small"):
        alone = openai.OpenAI(base_url=routers[name].url + "/v1", api_key="-", max_retries=0)
        for prompt in PROMPTS:
            raw = both.completions.with_raw_response.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
            done = raw.parse()
            assert done.model == name and raw.headers["x-hetserve-model"] == name
            assert raw.headers["x-worker-id"] in place[name]
            ref = alone.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
            assert done.choices[0].text == ref.choices[0].text, (name, prompt)
            texts[name, prompt] = done.choices[0].text
        chat = both.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=8, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        ref = alone.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPTS[0]}],
                                            max_tokens=8, temperature=0)
        assert streamed == ref.choices[0].message.content
    assert any(texts["big", p] != texts["small", p] for p in PROMPTS)  # two models, two answers
    with pytest.raises(openai.NotFoundError) as e:
        both.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found" and "Models: big, small" in e.value.message


def test_tgi_routes_take_the_model_header_and_every_series_names_its_model(routers):
    url = routers["both"].url
    default = httpx.post(url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    small = httpx.post(url + "/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
                       headers={"X-Hetserve-Model": "small"})
    assert default.headers["x-hetserve-model"] == "big" and default.headers["x-worker-id"] in ("gpu1", "gpu2")
    assert small.headers["x-hetserve-model"] == "small" and small.headers["x-worker-id"] == "gpu0"
    pinned = httpx.post(url + "/generate", json={"inputs": "Hi"}, headers={"X-Hetserve-Model": "small",
                                                                            "X-Hetserve-Worker": "gpu1"})
    assert pinned.status_code == 422 and "gpu1 serves big" in pinned.json()["error"]
    assert pinned.headers["x-hetserve-model"] == "small"
    # a request the edge refuses before any worker sees it still names its model
    bad = httpx.post(url + "/generate", json={"inputs": "Hi", "parameters": {"temperature": -1}},
                     headers={"X-Hetserve-Model": "small"})
    assert bad.status_code == 422 and bad.headers["x-hetserve-model"] == "small"
    bad = httpx.post(url + "/v1/completions", json={"model": "small", "prompt": "Hi", "max_tokens": -2})
    assert bad.status_code == 422 and bad.headers["x-hetserve-model"] == "small"
    bad = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": -2})
    assert bad.status_code == 422 and bad.headers["x-hetserve-model"] == "big"  # the default
    text = httpx.get(url + "/metrics").text
    assert metric_value(text, "hetserve_router_worker_requests_total", worker_id="gpu0", model="small") >= 1
    assert metric_value(text, "hetserve_worker_requests_total", worker_id="gpu1", model="big") is not None


# --- on demand, with stand-in workers -------------------------------------------------------------
KEY = "models-key"


def _model_dirs(root, names):
    for name in names:
        (root / name).mkdir(parents=True)
        shutil.copy(DEFAULT_MODEL_DIR / "config.json", root / name / "config.json")
    return root


def _workers(router) -> list[dict]:
    return httpx.get(router.url + "/workers", headers={"authorization": f"Bearer {KEY}"}).json()["workers"]


@pytest.fixture(scope="module")
def on_demand(tmp_path_factory):
    root = _model_dirs(tmp_path_factory.mktemp("od"), ("a", "b", "c"))
    r = RouterProcess(["--simulate", "sm_80,sm_89,sm_90", "--models-dir", str(root), "--max-loaded-models", "2",
                       "--pin-model", "a", "--api-key", KEY, "--model-min-residence-s", "0"],
                      env={"FAKE_STARTUP_S": "0.3", "FAKE_TOKEN_S": "0.01"})
    yield r
    r.stop()
    assert not r.orphans


def test_three_models_under_max_loaded_2_load_and_unload_without_losing_a_request(on_demand):
    auth = {"authorization": f"Bearer {KEY}"}
    assert [(w["id"], w["model"]["name"]) for w in _workers(on_demand)] == [("gpu0", "a"), ("gpu1", "a"),
                                                                             ("gpu2", "a")]

    def ask(i: int):
        model = "abc"[i % 3] if i % 4 else "a"
        r = httpx.post(on_demand.url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": model, "prompt": "x y", "max_tokens": 4})
        return model, r.status_code, r.headers, r.json()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(48)))
    answered = 0
    for model, code, headers, body in results:
        if code == 200:
            answered += 1
            assert body["model"] == model and headers["x-hetserve-model"] == model
            assert body["choices"][0]["text"] == " t0 t1 t2 t3"
        else:  # the only other answer: a clear 503 saying to come back
            assert code == 503 and headers["retry-after"] == "1", (code, body)
            assert headers["x-hetserve-model"] == model and body["error"]["message"]
    assert answered >= 36, [r[1] for r in results]
    for i in (1, 2, 0):  # and each model asked on its own, one after the other, is served
        assert ask(i)[1] == 200
    status = httpx.get(on_demand.url + "/workers", headers=auth).json()
    models = {m["name"]: m for m in status["models"]}
    assert sum(m["state"] == "loaded" for m in models.values()) == 2 and models["a"]["state"] == "loaded"
    assert models["a"]["pinned"] and models["a"]["unloads"] == 0
    assert models["b"]["loads"] + models["c"]["loads"] >= 2 and models["b"]["unloads"] + models["c"]["unloads"] >= 1
    text = httpx.get(on_demand.url + "/metrics", headers=auth).text
    assert metric_value(text, "hetserve_router_model_loads_total", model="b") == models["b"]["loads"]
    assert metric_value(text, "hetserve_router_model_state", model="a", state="loaded") == 1
    stats = httpx.get(on_demand.url + "/stats", headers=auth).json()
    assert [m["name"] for m in stats["models"]] == ["a", "b", "c"]
    log = on_demand.output()
    assert "loading model b on" in log and "unloaded (" in log and "model c loaded on" in log


def test_load_and_unload_by_hand_need_the_key_and_keep_a_pinned_model(on_demand):
    url, auth = on_demand.url, {"authorization": f"Bearer {KEY}"}
    assert httpx.post(url + "/models/b/load").status_code == 401
    loaded = httpx.post(url + "/models/b/load", headers=auth, timeout=60)
    assert loaded.status_code == 200 and loaded.json()["state"] == "loaded" and loaded.json()["workers"]
    (where,) = loaded.json()["workers"]
    placed = next(w for w in _workers(on_demand) if w["id"] == where)["placement"]
    assert placed["model"] == "b" and "the smallest device that holds b" in placed["reason"]
    gone = httpx.post(url + "/models/b/unload", headers=auth, timeout=60)
    assert gone.status_code == 200 and gone.json()["state"] == "unloaded" and gone.json()["workers"] == []
    assert all(w["model"]["name"] != "b" for w in _workers(on_demand))
    # its device is free now, and says why
    freed = next(p for p in httpx.get(url + "/workers", headers=auth).json()["placement"] if p["worker_id"] == where)
    assert freed["model"] is None and freed["role"] == "free"
    assert freed["reason"] == "free: b unloaded (unloaded by request)"
    pinned = httpx.post(url + "/models/a/unload", headers=auth)
    assert pinned.status_code == 409 and "pinned" in pinned.json()["error"]
    unknown = httpx.post(url + "/models/zz/load", headers=auth)
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "model_not_found"
    assert "Models: a, b, c" in unknown.json()["error"]


def test_a_request_held_longer_than_the_bound_gets_503_with_retry_after(tmp_path):
    """Guards the `left <= 0` bound of `Dispatcher._acquire` for an unloaded model."""
    from server.config.models import ModelEntry, ModelsConfig

    root = _model_dirs(tmp_path, ("a", "b"))
    models = ModelsConfig((ModelEntry("a", root / "a"), ModelEntry("b", root / "b")), max_loaded=1,
                          min_residence_s=0)
    with inprocess_router("sm_80,sm_90", env={"FAKE_STARTUP_S": "1.5"}, models=models, model_dir=root / "a",
                          ready_wait_s=0.5) as client:
        t0 = time.monotonic()
        r = client.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and time.monotonic() - t0 < 1.4
        assert "`b` is loading" in r.json()["error"]["message"]
        deadline = time.monotonic() + 20
        while client.get("/health").json()["models"]["b"] != "loaded":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert client.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 1}).status_code == 200
        assert client.get("/health").json()["models"] == {"a": "unloaded", "b": "loaded"}


def test_a_stream_whose_worker_dies_moves_only_to_a_worker_of_its_own_model(tmp_path):
    """Guards `Constraints.model` in server/routing/filter.py `_fits` (`handle.model != c.model`):
    the migration's pick goes through the same filter, so `a`'s stream never lands on `b`'s worker."""
    from tests.router_harness import sse_events

    root = _model_dirs(tmp_path, ("a", "b"))
    r = RouterProcess(["--simulate", "sm_80,sm_89,sm_90", "--model", f"a={root / 'a'}", "--model", f"b={root / 'b'}",
                       "--place", "a=gpu0,gpu2", "--place", "b=gpu1", "--routing", "round-robin"],
                      env={"FAKE_CRASH_IDS": "gpu0", "FAKE_TOKEN_S": "0.01"})
    try:
        body = {"inputs": "__crash_mid_stream__", "parameters": {"max_new_tokens": 6, "details": True}}
        moved = []
        for _ in range(2):  # round-robin: one of the two starts on gpu0, which dies after two tokens
            got = httpx.post(r.url + "/generate_stream", json=body, headers={"X-Hetserve-Model": "a"}, timeout=60)
            assert got.status_code == 200 and got.headers["x-hetserve-model"] == "a"
            events = sse_events(got.text)
            assert [e["index"] for e in events] == list(range(6)), events  # no gap, no repeat
            if got.headers["x-worker-id"] == "gpu0":
                moved.append(events[-1]["details"].get("migrations"))
        assert moved == [1]
        text = httpx.get(r.url + "/metrics").text
        assert not metric_value(text, "hetserve_router_worker_requests_total", worker_id="gpu1", model="b")
        assert metric_value(text, "hetserve_router_worker_requests_total", worker_id="gpu2", model="a") >= 2
    finally:
        r.stop()
    assert not r.orphans
