"""The host KV tier through a real `hetserve serve` with two simulated workers of the embedded
model: they share one tier in /dev/shm (same directory, same format key on `/workers`), the
second continues a conversation the first began without recomputing its prefix, and the tier
is removed when the server stops, or at the next start after a kill -9. A stream whose worker
drains or is killed with -9 continues on the other from what that worker had put in the tier."""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.fleet.kv_tier_dir import tier_parent
from tests.router_harness import ROOT, RouterProcess, alive, running_router
from workers.contract import DEFAULT_MODEL_DIR, HEADER_PIN_WORKER, KV_TIER_PREFIX

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

STORY = ("The history of the river valley and the towns along its banks, told from the first settlers who "
         "came with their cattle and their seed corn, to the mills and the railway and the bridge that the "
         "floods of that long wet spring carried away, and what the people did then")


# Its workers drain for at most 0.1 s after SIGTERM (tests/short_drain_worker.py), and each forward
# takes three times as long (workers/device/slowdown.py), so that a long stream is still under way
# when its worker is stopped.
WORKER = f"{sys.executable} {ROOT / 'tests/short_drain_worker.py'}"


@pytest.fixture(scope="module")
def router():
    yield from running_router(["--simulate", "sm_80,sm_90", "--dtype", "float32", "--kv-block-size", "16",
                               "--canary-interval", "0"],
                              env={"HETSERVE_WORKER_CMD": WORKER, "HETSERVE_SLOWDOWN": "3"},
                              fake=False, ready_timeout=240)


def _tier(router: RouterProcess, wid: str) -> dict:
    return router.worker(wid)["capacity"]["kv_host_tier"]


def _generate(router: RouterProcess, wid: str, text: str) -> str:
    with router.client() as c:
        r = c.post("/generate", json={"inputs": text, "parameters": {"max_new_tokens": 12}},
                   headers={HEADER_PIN_WORKER: wid})
    assert r.status_code == 200, r.text
    assert r.headers["X-Worker-Id"] == wid
    return r.json()["generated_text"]


def test_the_workers_share_one_tier_and_the_second_continues_the_firsts_conversation(router):
    tiers = {wid: _tier(router, wid) for wid in ("gpu0", "gpu1")}
    for t in tiers.values():
        assert t["enabled"] and t["directory"].startswith(str(tier_parent())), t
        assert Path(t["directory"]).parent.name.startswith(KV_TIER_PREFIX)
    assert tiers["gpu0"]["directory"] == tiers["gpu1"]["directory"]
    assert tiers["gpu0"]["format_key"] == tiers["gpu1"]["format_key"]
    first = _generate(router, "gpu0", STORY)
    turn = STORY + first + " And after that, the valley"
    router.wait_for(lambda: _tier(router, "gpu0")["blocks_written"] > 0, timeout=20)
    on_second = _generate(router, "gpu1", turn)
    on_first = _generate(router, "gpu0", turn)  # its own device cache holds the prefix
    assert on_second == on_first
    loaded = router.wait_for(lambda: _tier(router, "gpu1")["blocks_loaded"], timeout=20)
    assert loaded >= 4, _tier(router, "gpu1")
    for wid, other in (("gpu0", "gpu1"), ("gpu1", "gpu0")):  # the router knows who shares a tier
        assert router.worker(wid)["routing"]["host_tier"]["shared_with"] == [other]


LONG = 240  # tokens of a stream that its worker loses
STOP_AFTER = 20  # pieces the client has when the worker serving it is stopped
COMPUTED = "hetserve_worker_prefill_tokens_total"  # {kind="computed"}: prompt tokens a worker computed


def _long_stream(router: RouterProcess, prompt: str, sig: int | None = None) -> dict:
    """One greedy `/v1/completions` stream of `LONG` tokens; with `sig`, that signal goes to the
    worker serving it once the client has `STOP_AFTER` pieces. Its text, usage, first worker and
    moves."""
    pids = {w["id"]: w["pid"] for w in router.workers()}
    body = {"prompt": prompt, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = {"pieces": [], "migrations": 0, "usage": None}
    with httpx.Client(base_url=router.url, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        out["worker"] = r.headers["x-worker-id"]
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event
            for choice in event.get("choices") or []:
                out["pieces"].append(choice["text"])
                if choice["finish_reason"] is not None:
                    out["migrations"] = event.get("migrations", 0)
            out["usage"] = event.get("usage") or out["usage"]
            if sig is not None and len(out["pieces"]) == STOP_AFTER:
                os.kill(pids[out["worker"]], sig)
    out["text"] = "".join(out["pieces"])
    return out


def _all_ready(router: RouterProcess) -> None:
    router.wait_for(lambda: all(w["state"] == "ready" for w in router.workers()), timeout=120, interval=0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["drained", "killed"])
def test_a_stream_that_loses_its_worker_continues_from_the_tier(router, sig):
    """A stream whose worker drains (SIGTERM: its drain ends before the stream) or is killed with -9
    continues on the other worker, whose device has never seen its prompt, with the text of an
    undisturbed run. Drained, the worker wrote every token it had computed to the tier before
    ending the stream (workers/kvtier/publish.py `publish`, the partly filled last block too): the
    next worker computes no prompt token at all. Killed, the blocks its writer had written are
    read back, the prompt's among them, and only the rest is computed."""
    _all_ready(router)
    prompt = f"Chapter {sig.name}. {STORY}"  # a prompt of its own: on no device yet
    other = {"gpu0": "gpu1", "gpu1": "gpu0"}
    before = {wid: (_tier(router, wid), router.metric(COMPUTED, worker_id=wid, kind="computed") or 0.0)
              for wid in other}
    run = _long_stream(router, prompt, sig)
    assert run["migrations"] == 1, run
    taken = other[run["worker"]]
    tier = _tier(router, taken)
    loaded = tier["blocks_loaded"] - before[taken][0]["blocks_loaded"]
    computed = router.metric(COMPUTED, worker_id=taken, kind="computed") - before[taken][1]
    prompt_tokens = run["usage"]["prompt_tokens"]
    assert loaded >= prompt_tokens // 16, (before[taken][0], tier)
    if sig == signal.SIGTERM:
        assert computed == 0, f"the resume computed {computed} prompt tokens again"
        assert loaded > prompt_tokens // 16 + STOP_AFTER // 16, (before[taken][0], tier)  # generated ones too
    else:
        assert computed < prompt_tokens, f"the resume computed {computed} tokens, the prompt alone is {prompt_tokens}"
    reference = _long_stream(router, prompt)  # on the worker that is ready while the other restarts
    assert reference["migrations"] == 0 and reference["usage"]["completion_tokens"] == LONG
    assert run["text"] == reference["text"]


def test_a_stopped_server_removes_its_tier_and_a_killed_ones_is_swept_at_the_next_start():
    """Guards `remove_tier_dir` at stop and `sweep_stale_tier_dirs` at start (server/fleet/supervisor.py)."""
    def tiers_of(pid: int) -> list[str]:
        return glob.glob(str(tier_parent() / f"{KV_TIER_PREFIX}hetserve-{pid}-*"))

    killed = RouterProcess(["--simulate", "sm_80"], fake=True)
    made = tiers_of(killed.proc.pid)
    assert len(made) == 1
    killed.stop(sig=signal.SIGKILL)
    assert Path(made[0]).is_dir(), "a router killed with -9 cleans nothing"
    deadline = time.monotonic() + 10
    while alive(killed.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    second = RouterProcess(["--simulate", "sm_80"], fake=True)
    try:
        assert not Path(made[0]).exists(), "the next start sweeps the dead router's tier"
        own = tiers_of(second.proc.pid)
        assert len(own) == 1
    finally:
        second.stop()
    assert not Path(own[0]).exists(), "a stopped server removes its tier"
