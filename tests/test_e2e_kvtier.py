"""The host KV tier through a real `hetserve serve` with two simulated workers of the embedded
model: they share one tier in /dev/shm (same directory, same format key on `/workers`), the
second continues a conversation the first began without recomputing its prefix, and the tier
is removed when the server stops, or at the next start after a kill -9."""

from __future__ import annotations

import glob
import signal
import time
from pathlib import Path

import pytest

from server.fleet.kv_tier_dir import tier_parent
from tests.router_harness import RouterProcess, alive, running_router
from workers.contract import DEFAULT_MODEL_DIR, HEADER_PIN_WORKER, KV_TIER_PREFIX

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (DEFAULT_MODEL_DIR / "config.json").is_file(), reason="the embedded model is not built"),
]

STORY = ("The history of the river valley and the towns along its banks, told from the first settlers who "
         "came with their cattle and their seed corn, to the mills and the railway and the bridge that the "
         "floods of that long wet spring carried away, and what the people did then")


@pytest.fixture(scope="module")
def router():
    yield from running_router(["--simulate", "sm_80,sm_90", "--dtype", "float32", "--kv-block-size", "16"],
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
