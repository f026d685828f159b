"""Loading and unloading models: who may ask, and how often a request may make a worker start.

Real `hetserve serve` processes over stand-in workers (tests/router_fake_worker.py), two models
and `--max-loaded-models 1` on one device:
- without `--api-key`, `POST /models/{name}/load|unload` are 403 naming the flags, and
  `--allow-unauthenticated-control` opens them;
- requests alternating between the two models do not start a worker each: the loaded model stays
  for its minimum residence (`--model-min-residence-s`, default 30 s), and what would unload it is
  a 503 with `Retry-After` saying so (`/tokenize` too), until the residence is over;
- the supervisor keeps no task of a retired worker (in process: its task set is read).
"""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

from server.config.models import DEFAULT_MIN_RESIDENCE_S, ModelEntry, ModelsConfig
from tests.inprocess_router import inprocess_router
from tests.router_harness import RouterProcess, metric_value
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.slow


def _models(root) -> list[str]:
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        shutil.copy(DEFAULT_MODEL_DIR / "config.json", root / name / "config.json")
    return ["--model", f"a={root / 'a'}", "--model", f"b={root / 'b'}", "--max-loaded-models", "1"]


def _complete(router, model: str) -> httpx.Response:
    return httpx.post(router.url + "/v1/completions", json={"model": model, "prompt": "x y", "max_tokens": 2},
                      timeout=60)


def test_control_routes_refuse_without_a_key_naming_the_flag(tmp_path):
    """Guards `_refused` in server/edge/routes/models.py: without it, both routes answer 200 to anyone."""
    router = RouterProcess(["--simulate", "sm_80", *_models(tmp_path)], env={"FAKE_STARTUP_S": "0.2"})
    try:
        for action in ("load", "unload"):
            r = httpx.post(f"{router.url}/models/a/{action}", timeout=30)
            assert r.status_code == 403, r.text
            assert "--allow-unauthenticated-control" in r.json()["error"] and "--api-key" in r.json()["error"]
        assert router.workers()[0]["model"]["name"] == "a"  # nothing was unloaded
    finally:
        router.stop()
    opened = RouterProcess(["--simulate", "sm_80", *_models(tmp_path / "open"), "--allow-unauthenticated-control"],
                           env={"FAKE_STARTUP_S": "0.2"})
    try:
        gone = httpx.post(f"{opened.url}/models/a/unload", timeout=30)
        assert gone.status_code == 200 and gone.json()["state"] == "unloaded"
        back = httpx.post(f"{opened.url}/models/a/load", timeout=60)
        assert back.status_code == 200 and back.json()["state"] == "loaded"
    finally:
        opened.stop()


def test_alternating_models_wait_for_the_residence_instead_of_starting_a_worker_each(tmp_path):
    """Guards the `resident` models of server/fleet/on_demand.py `plan_load` (and `request_load`'s
    check before it starts anything): without them every request for the other model unloads the
    loaded one and starts a worker for its own."""
    assert DEFAULT_MIN_RESIDENCE_S == 30.0
    router = RouterProcess(["--simulate", "sm_80", *_models(tmp_path)], env={"FAKE_STARTUP_S": "0.5"})
    try:
        for model in ("a", "b", "a", "b", "a", "b"):
            r = _complete(router, model)
            if model == "a":
                assert r.status_code == 200, r.text
            else:
                assert r.status_code == 503 and r.headers["retry-after"], r.text
                message = r.json()["error"]["message"]
                assert "minimum residence (--model-min-residence-s)" in message and "`a`" in message, message
        tokenized = httpx.post(router.url + "/tokenize", json={"model": "b", "prompt": "x"}, timeout=60)
        assert tokenized.status_code == 503 and "--model-min-residence-s" in tokenized.text
        text = httpx.get(router.url + "/metrics").text
        assert not metric_value(text, "hetserve_router_model_loads_total", model="b")
        assert not metric_value(text, "hetserve_router_model_unloads_total", model="a")
        assert router.output().count("started pid") == 1  # the one worker, started once
    finally:
        router.stop()


def test_once_the_residence_is_over_the_other_model_loads(tmp_path):
    router = RouterProcess(["--simulate", "sm_80", *_models(tmp_path), "--model-min-residence-s", "3"],
                           env={"FAKE_STARTUP_S": "0.3"})
    try:
        early = _complete(router, "b")
        assert early.status_code == 503
        wait = int(early.headers["retry-after"])
        assert "retry after" in early.json()["error"]["message"] and 1 <= wait <= 3
        time.sleep(3.2)
        assert _complete(router, "b").status_code == 200
        assert _complete(router, "a").status_code == 503  # b is resident now
    finally:
        router.stop()


def test_a_bad_residence_is_refused_by_name(tmp_path):
    from server.cli import main

    assert main(["serve", "--model-min-residence-s", "-1"]) == 2


def test_the_supervisor_keeps_no_task_of_a_retired_worker(tmp_path):
    """Guards `_start_lifecycle`'s done callback (server/fleet/supervisor.py): without it the task
    set grows by one per load and holds every retired worker's task for the router's life."""
    root = tmp_path
    _models(root)
    models = ModelsConfig((ModelEntry("a", root / "a"), ModelEntry("b", root / "b")), max_loaded=1,
                          min_residence_s=0)
    with inprocess_router("sm_80", env={"FAKE_STARTUP_S": "0.2"}, models=models, model_dir=root / "a",
                          allow_unauthenticated_control=True) as client:
        for model in ("b", "a", "b", "a", "b"):
            assert client.post(f"/models/{model}/load").status_code == 200
        supervisor = client.app.state.ctx.supervisor
        deadline = time.monotonic() + 10
        while len(supervisor._tasks) != len(supervisor.workers):
            assert time.monotonic() < deadline, (len(supervisor._tasks), list(supervisor.workers))
            time.sleep(0.05)
        assert len(supervisor._tasks) == 1
