"""End to end, the embedded model in float32 on two simulated workers: nothing lost mid-stream.

Eight concurrent greedy streams of 64 tokens (half TGI `/generate_stream`, half OpenAI
`/v1/completions`) run once undisturbed, then again while the worker serving the first of
them is killed with SIGKILL, or frozen with SIGSTOP, after about 20 tokens: every stream must
still end with exactly 64 tokens and the very text (TGI: the very token ids) of the
undisturbed run, and the streams that lost their worker say they moved. A client that goes
away mid-stream (both kinds) aborts its request on the worker. The prompts are short
held-out fortune openings that the model continues for 64 tokens without an end-of-text.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.router_harness import RouterProcess, metric_value, running_router
from workers.contract import DEFAULT_MODEL_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

PROMPTS = ["So far behind", "dogs come when", "Only in the", "In a five", "works, and boy,", "Project MAC, I",
           "to happen tomorrow,", "Peep Cleaners by"]
NEW_TOKENS = 64
KILL_AFTER = 20  # tokens the first stream has received when its worker is killed or frozen
HEALTH_TIMEOUT_S = 2.0


# Each forward takes this many times as long (workers/device/slowdown.py): on fast cores eight
# streams of 64 tokens otherwise end before the disturbing thread, competing with the eight
# reading threads for the GIL, sees stream 0 at its kill point.
SLOWDOWN = "3"


@pytest.fixture(scope="module")
def router():
    yield from running_router(["--simulate", "sm_80,sm_90", "--dtype", "float32", "--health-timeout",
                               str(HEALTH_TIMEOUT_S)], env={"HETSERVE_SLOWDOWN": SLOWDOWN}, fake=False,
                              ready_timeout=240)


def _request(i: int) -> tuple[str, dict]:
    """Even streams speak TGI, odd ones OpenAI (greedy both)."""
    if i % 2 == 0:
        return "/generate_stream", {"inputs": PROMPTS[i], "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    return "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True,
                               "stream_options": {"include_usage": True}}


def _read(url: str, i: int, progress: list[int], first_worker: dict[int, str]) -> dict:
    """One stream to its end: its text, token ids (TGI), indices (TGI), token count, moves, error."""
    path, body = _request(i)
    out = {"pieces": [], "ids": [], "indices": [], "tokens": None, "migrations": 0, "error": None, "final_text": None}
    with httpx.Client(base_url=url, timeout=120) as client, client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        first_worker[i] = r.headers["x-worker-id"]
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out["error"] = event["error"]
                break
            if i % 2 == 0:
                out["ids"].append(event["token"]["id"])
                out["indices"].append(event["index"])
                if not event["token"]["special"]:
                    out["pieces"].append(event["token"]["text"])
                if event["details"] is not None:
                    out["tokens"] = event["details"]["generated_tokens"]
                    out["migrations"] = event["details"].get("migrations", 0)
                    out["final_text"] = event["generated_text"]
            else:
                for choice in event.get("choices") or []:
                    out["pieces"].append(choice["text"])
                    if choice["finish_reason"] is not None:
                        out["migrations"] = event.get("migrations", 0)
                if event.get("usage"):
                    out["tokens"] = event["usage"]["completion_tokens"]
            progress[i] += 1
    out["text"] = "".join(out["pieces"])
    return out


def _run_all(router: RouterProcess, disturb=None) -> tuple[list[dict], dict[int, str], object]:
    """The eight streams at once; `disturb(progress, first_worker)` runs meanwhile."""
    progress, first_worker = [0] * len(PROMPTS), {}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(_read, router.url, i, progress, first_worker) for i in range(len(PROMPTS))]
        note = disturb(progress, first_worker) if disturb else None
        return [f.result(timeout=180) for f in futures], first_worker, note


@pytest.fixture(scope="module")
def reference(router) -> list[dict]:
    runs, _, _ = _run_all(router)
    for i, run in enumerate(runs):
        assert run["error"] is None and run["tokens"] == NEW_TOKENS, (PROMPTS[i], run)
    return runs


def _disturb(router: RouterProcess, sig: int):
    """Send `sig` to the worker serving stream 0 once it has KILL_AFTER tokens; the returned
    function gives (victim's /workers entry, seconds until the router took it out of rotation)."""
    before = {w["id"]: w for w in router.workers()}  # read now: at the kill point there is no time for it

    def disturb(progress, first_worker):
        deadline = time.monotonic() + 60
        while progress[0] < KILL_AFTER or 0 not in first_worker:
            assert time.monotonic() < deadline, "stream 0 never reached its kill point"
            time.sleep(0.001)
        victim = before[first_worker[0]]
        os.kill(victim["pid"], sig)
        sent, at = time.monotonic(), progress[0]
        assert at < NEW_TOKENS - 8, f"stream 0 was at {at} tokens when its worker was stopped: too late to test"
        router.wait_for(lambda: router.worker(victim["id"])["state"] != "ready", timeout=30, interval=0.05)
        return victim, time.monotonic() - sent

    return disturb


def _check_nothing_lost(runs, reference, first_worker, victim_id) -> None:
    moved = [i for i in range(len(PROMPTS)) if first_worker[i] == victim_id]
    assert moved, "no stream was on the victim"
    for i, (run, ref) in enumerate(zip(runs, reference, strict=True)):
        assert run["error"] is None, (PROMPTS[i], run["error"])
        assert run["tokens"] == NEW_TOKENS and run["text"] == ref["text"], (PROMPTS[i], run, ref)
        if i % 2 == 0:  # TGI: every token once, in order, the same ids
            assert run["indices"] == list(range(NEW_TOKENS)) and run["ids"] == ref["ids"]
            assert run["final_text"] == ref["final_text"]
        assert run["migrations"] == (1 if i in moved else 0), (i, first_worker, run["migrations"])


def _wait_all_ready(router: RouterProcess) -> None:
    router.wait_for(lambda: all(w["state"] == "ready" for w in router.workers()), timeout=120, interval=0.2)


def _worker_series(router: RouterProcess, wid: str) -> dict[str, float]:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    return {
        "aborted": metric_value(text, "hetserve_worker_requests_total", worker_id=wid, finish_reason="aborted") or 0.0,
        "generated": metric_value(text, "hetserve_worker_generated_tokens_total", worker_id=wid),
        "running": metric_value(text, "vllm:num_requests_running", worker_id=wid),
    }


def _leave_early(router: RouterProcess, kind: str, new_tokens: int) -> None:
    """Start a long generation on gpu0 and go away: after 5 events (streams) or 0.3 s (`generate`)."""
    headers = {"X-Hetserve-Worker": "gpu0"}
    if kind == "generate":
        body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": new_tokens}}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.url}/generate", json=body, headers=headers, timeout=httpx.Timeout(30, read=0.3))
        return
    path, body = _request(0 if kind == "tgi" else 1)
    body.get("parameters", body)["max_new_tokens" if kind == "tgi" else "max_tokens"] = new_tokens
    with httpx.Client(base_url=router.url, timeout=60) as client, client.stream(
            "POST", path, json=body, headers=headers) as r:
        lines, got = r.iter_lines(), 0
        while got < 5:
            got += next(lines).startswith("data:")
    # the response and its connection are closed here


@pytest.mark.parametrize("kind", ["tgi", "openai", "generate"])
def test_client_going_away_aborts_the_worker_request(router, kind):
    """Guards the relay closing its worker stream when the client leaves (`RelayResponse`,
    `close_shielded`) and the disconnect guard (server/edge/disconnect.py) for `/generate`: without
    them the worker generates all 480 tokens for nobody and finishes with `length`, not `aborted`."""
    _wait_all_ready(router)
    before = _worker_series(router, "gpu0")
    _leave_early(router, kind, 480)
    after = router.wait_for(lambda: (s := _worker_series(router, "gpu0"))["aborted"] > before["aborted"] and s,
                            timeout=10, interval=0.05)
    assert after["running"] == 0
    generated = after["generated"] - before["generated"]
    assert generated < (100 if kind != "generate" else 480), f"{generated} tokens generated for a client that left"
    time.sleep(0.3)
    assert _worker_series(router, "gpu0")["generated"] == after["generated"]


def test_kill_9_mid_stream_loses_and_repeats_nothing(router, reference):
    """Guards `ClientStream._move` and the worker's `resume_ids`: without them the streams of the
    killed worker end with an `incomplete_generation` error after ~20 tokens."""
    _wait_all_ready(router)
    runs, first_worker, (victim, _) = _run_all(router, _disturb(router, signal.SIGKILL))
    _check_nothing_lost(runs, reference, first_worker, victim["id"])
    moved = router.metric("hetserve_router_worker_stream_migrations_total", worker_id=victim["id"])
    assert moved >= sum(first_worker[i] == victim["id"] for i in first_worker)
    back = router.wait_for(lambda: (w := router.worker(victim["id"]))["state"] == "ready" and w, timeout=120)
    assert "SIGKILL" in back["last_exit"] and back["restarts"] == victim["restarts"] + 1


def test_sigstop_mid_stream_is_detected_and_its_streams_move(router, reference):
    """Guards the probe timeout in `server/fleet/probe.py` and `Supervisor._replace_hung` (broken
    connections, SIGTERM then SIGKILL): without them a frozen worker's streams wait forever."""
    _wait_all_ready(router)
    runs, first_worker, (victim, took) = _run_all(router, _disturb(router, signal.SIGSTOP))
    assert took <= 1.0 + HEALTH_TIMEOUT_S + 1.5, f"a frozen worker was taken out after {took:.1f}s"
    _check_nothing_lost(runs, reference, first_worker, victim["id"])
    gone = router.wait_for(lambda: (w := router.worker(victim["id"]))["restarts"] > victim["restarts"] and w,
                           timeout=30)  # SIGTERM, then SIGKILL after 5 s
    assert gone["last_exit"].startswith("hung: /health did not answer"), gone["last_exit"]
