"""End to end: the router's canary over three real workers (`--simulate sm_89,sm_89,sm_89`,
the embedded model, `--deterministic`), one of them made to compute wrong by the test-only
fault injection (tests/perturbed_worker.py, started in place of `python -m workers`): the canary marks
exactly that worker suspect within one interval, the others stay healthy with exact
agreement, and `--canary-action drain` keeps it out of rotation (restarted, checked again,
still wrong, so held)."""

from __future__ import annotations

import sys
import time

import pytest

from tests.perturbed_worker import ENV_PERTURB_LOGITS
from tests.router_harness import ROOT, running_router
from workers.contract import HEADER_WORKER_ID

pytestmark = pytest.mark.slow

INTERVAL_S = 3.0


@pytest.fixture(scope="module")
def router():
    yield from running_router(
        ["--simulate", "sm_89,sm_89,sm_89", "--deterministic", "--max-batch", "4",
         "--canary-interval", str(INTERVAL_S), "--canary-action", "drain"],
        env={ENV_PERTURB_LOGITS: "gpu1:4",
             "HETSERVE_WORKER_CMD": f"{sys.executable} {ROOT / 'tests/perturbed_worker.py'}"},
        fake=False, ready_timeout=240, expect_ready=2)


def _canary(router, wid: str) -> dict | None:
    return router.worker(wid).get("canary")


def test_the_perturbed_worker_is_suspect_within_one_interval(router):
    ready_at = time.monotonic()
    bad = router.wait_for(lambda: (c := _canary(router, "gpu1")) and c.get("verdict") == "suspect" and c,
                          timeout=INTERVAL_S + 30)
    assert time.monotonic() - ready_at < INTERVAL_S + 30
    assert bad["agreement"] < 0.9 and bad["expected"] == "exact"
    for wid in ("gpu0", "gpu2"):
        good = router.wait_for(lambda w=wid: (c := _canary(router, w)) and c.get("verdict") and c)
        assert good["verdict"] == "healthy" and good["agreement"] == 1.0 and good["max_logprob_diff"] == 0.0
        assert good["expected"] == "exact"
        assert router.worker(wid)["deterministic"]["enabled"] is True
    assert router.metric("hetserve_canary_agreement", worker_id="gpu0", capability="8.9") == 1.0
    assert router.metric("hetserve_canary_agreement", worker_id="gpu1") < 0.9
    assert router.metric("hetserve_canary_suspect", worker_id="gpu1") == 1.0
    assert router.metric("hetserve_canary_suspect", worker_id="gpu2") == 0.0
    assert router.metric("hetserve_canary_max_logprob_diff", worker_id="gpu1") > 0


def test_drain_takes_it_out_of_rotation(router):
    assert router.wait_for(lambda: (c := _canary(router, "gpu1")) and c.get("held"), timeout=60)
    health = router.client().get("/health").json()
    assert health["status"] == "degraded" and health["canary_suspects"] == ["gpu1"]
    served = set()
    with router.client() as c:
        for i in range(12):
            r = c.post("/generate", json={"inputs": f"Hello {i}", "parameters": {"max_new_tokens": 2}})
            assert r.status_code == 200
            served.add(r.headers[HEADER_WORKER_ID])
    assert served <= {"gpu0", "gpu2"} and served
    # restarted (a new process) and checked again before serving: still wrong, so still held
    router.wait_for(lambda: router.worker("gpu1")["restarts"] >= 1, timeout=120)
    restarted_at = time.time()
    again = router.wait_for(lambda: (c := _canary(router, "gpu1"))["checked_at"] > restarted_at and c, timeout=120)
    assert again["verdict"] == "suspect" and again["held"]
    assert router.worker("gpu1")["state"] == "ready"  # alive and answering, yet not routed to
