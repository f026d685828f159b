"""Pipeline stages as real worker processes: output identical to one worker, each stage its own device.

A 6-layer fp32 checkpoint served three ways side by side: one worker, a 2-stage pipeline (sm_80
+ sm_86) and a 3-stage one (sm_75 + sm_86 + sm_90), each pipeline's first stage started with a
plan file as the router writes it (workers/contract/pipeline.py), so the first stage starts the
others. Greedy answers must be identical under batching (concurrent requests), chunked prefill
(prompts longer than one step's 16 tokens), the prefix cache (a prompt repeated) and
preemption (a KV budget too small for every sequence at once); a stage killed with SIGKILL
ends its pipeline's first stage as a fatal error naming the stage.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.pipeline_harness import Served

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time there was a", "hello world", "the quick brown fox jumps over the lazy dog " * 3,
           "a b c d e f g h i j k l m n o p q r s t u v w x y z", "hello world"]

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    model = make_checkpoint(tmp / "six", num_hidden_layers=6)
    # 16 blocks of 8 tokens (each stage's budget for its own three layers): four long answers at once must preempt
    tight = ("--kv-cache-bytes", "196608")
    runs = {"one": Served(tmp, "one", model, ["sm_80"]),
            "two": Served(tmp, "two", model, ["sm_80", "sm_86"]),
            "three": Served(tmp, "three", model, ["sm_75", "sm_86", "sm_90"]),
            "three_mb": Served(tmp, "three_mb", model, ["sm_80", "sm_86", "sm_90"], ("--pipeline-microbatches", "3")),
            "tight_one": Served(tmp, "tight_one", model, ["sm_80"], tight),
            "tight_two": Served(tmp, "tight_two", model, ["sm_80", "sm_86"], ("--kv-cache-bytes", "98304"))}
    try:
        for s in runs.values():
            s.wait_ready()
        yield runs
    finally:
        for s in runs.values():
            s.stop()


def _texts(server: Served, prompts, n: int = 12) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:  # at once: the engine batches them
        return [r["generated_text"] for r in pool.map(lambda p: server.generate(p, n), prompts)]


def test_pipelines_answer_as_one_worker_does_batched_chunked_and_cached(served):
    """Concurrent requests, prompts over one step's 16 tokens (chunked prefill) and a repeated
    prompt (prefix cache) give the same greedy text on 1, 2 and 3 stages, and on 3 stages with
    each step cut into micro-batches."""
    want = _texts(served["one"], PROMPTS)
    assert _texts(served["two"], PROMPTS) == want
    assert _texts(served["three"], PROMPTS) == want
    assert _texts(served["three_mb"], PROMPTS) == want  # each step cut into 3 micro-batches on their way at once
    assert served["two"].generate(PROMPTS[2])["generated_text"] == want[2]  # again: from the prefix cache


def test_each_stage_runs_its_own_device_and_holds_only_its_layers(served):
    with served["three"].client() as c:
        cap = c.get("/capability").json()
    with served["one"].client() as c:
        whole = c.get("/capability").json()
    stages = cap["pipeline"]["stages"]
    assert [s["layers"] for s in stages] == [[0, 2], [2, 4], [4, 6]]
    assert [s["device"]["capability"] for s in stages] == ["7.5", "8.6", "9.0"]
    assert stages[0]["kernels"]["RMSNorm"]["reason"].startswith("sm_75")
    assert stages[2]["kernels"]["RMSNorm"]["reason"].startswith("sm_90")
    one_stage = sum(s["weights_bytes"] for s in stages)
    assert max(s["weights_bytes"] for s in stages) < one_stage * 0.6  # no stage holds the whole model
    assert "pipeline" not in whole and cap["capacity"]["kv_blocks_total"] > 0


def test_each_stage_counts_its_own_steps_in_the_first_stages_metrics(served):
    """`/metrics` of a 3-stage pipeline has every stage's steps, compute seconds and last-step age."""
    served["three"].generate("count these steps", 4)
    with served["three"].client() as c:
        text = c.get("/metrics").text
    from tests.router_harness import metric_value

    for stage in ("0", "1", "2"):
        assert metric_value(text, "hetserve_worker_pipeline_stage_steps_total", stage=stage) > 0, stage
        assert metric_value(text, "hetserve_worker_pipeline_stage_compute_seconds_total", stage=stage) > 0, stage
        assert metric_value(text, "hetserve_worker_pipeline_stage_last_step_age_seconds", stage=stage) >= 0, stage


def test_preempted_sequences_recompute_across_stages(served):
    """With a KV budget too small for four long answers at once, sequences are preempted and
    recomputed, and the pipeline's answers stay those of one worker under the same budget."""
    prompts = [f"story number {i} begins with" for i in range(4)]
    want = _texts(served["tight_one"], prompts, 40)
    assert _texts(served["tight_two"], prompts, 40) == want
    with served["tight_two"].client() as c:
        metrics = c.get("/metrics").text
        blocks = c.get("/capability").json()["capacity"]["kv_blocks_total"]
    with served["tight_one"].client() as c:
        assert c.get("/capability").json()["capacity"]["kv_blocks_total"] == blocks == 16
    preempted = [line for line in metrics.splitlines() if line.startswith("hetserve_worker_preemptions_total")]
    assert preempted and float(preempted[0].split()[-1]) > 0, preempted


def test_a_stage_killed_ends_its_first_stage_naming_it(tmp_path):
    """kill -9 of the middle stage mid-stream: the first stage stops serving at once with a fatal
    status that names the stage, and the last stage goes with it (nothing left running)."""
    model = make_checkpoint(tmp_path / "six", num_hidden_layers=6)
    s = Served(tmp_path, "victim", model, ["sm_80", "sm_86", "sm_90"])
    try:
        s.wait_ready()
        with s.client() as c:
            stages = c.get("/capability").json()["pipeline"]["stages"]
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(lambda: s.client().post("/generate", json={
                "inputs": "a long answer", "parameters": {"max_new_tokens": 400}}))
            time.sleep(1.0)
            os.kill(stages[1]["pid"], signal.SIGKILL)
            code = s.proc.wait(30)
            try:
                response = pending.result(30)
                assert response.status_code >= 500 or "error" in response.text
            except httpx.HTTPError:
                pass  # the connection closed with the worker: the router turns that into a clear error
        status = json.loads(s.status.read_text())
        assert code == 4 and status["state"] == "fatal", status
        assert "pipeline stage 1" in status["reason"] or "Connection" in status["reason"], status
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(stages[2]["pid"]):
            time.sleep(0.1)
        assert not _alive(stages[2]["pid"])
    finally:
        s.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_micro_batches_cut_in_order_by_tokens():
    """`micro_batches` keeps the chunks' order, leaves no run empty and balances tokens."""
    from types import SimpleNamespace

    from workers.pipeline.runner import micro_batches

    items = [(SimpleNamespace(num_tokens=n), [0] * n) for n in (1, 1, 1, 1, 12, 1, 1)]
    runs = micro_batches(items, 3)
    assert [x for run in runs for x in run] == items and len(runs) == 3 and all(runs)
    assert [sum(c.num_tokens for c, _ in run) for run in runs] == [4, 12, 2]
    assert micro_batches(items[:2], 5) == [[items[0]], [items[1]]] and micro_batches(items, 1) == [items]


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_a_hybrid_splits_each_stage_keeping_its_own_linear_layers_state(tmp_path, family):
    """Qwen3.5 (Gated DeltaNet and attention layers) as 2 stages: each keeps the recurrent state of
    its own linear layers only, in the slots the first stage assigns (no spare slots for snapshots: a
    pipeline's prefix cache is off for hybrids); greedy text equals one worker's."""
    from tests.family_checkpoints import make_family_checkpoint

    model = make_family_checkpoint(family, tmp_path / family)
    one, two = Served(tmp_path, "h1", model, ["sm_80"]), Served(tmp_path, "h2", model, ["sm_80", "sm_90"])
    try:
        one.wait_ready()
        two.wait_ready()
        prompts = PROMPTS[:4]
        assert _texts(two, prompts) == _texts(one, prompts)
        with two.client() as c:
            stages = c.get("/capability").json()["pipeline"]["stages"]
        with one.client() as c:
            capacity = c.get("/capability").json()["capacity"]
        # one worker's state pool also holds its snapshots' spare slots; a pipeline's stages none
        running, spare = capacity["state_slots"], capacity["state_snapshots"]["slots"]
        whole = capacity["state_bytes"] * running // (running + spare)
        assert [s["layers"] for s in stages] == [[0, 2], [2, 4]]
        assert stages[0]["kv_cache_bytes"] == 0 and stages[1]["kv_cache_bytes"] > 0  # layers 0, 1 are linear
        assert sum(s["state_bytes"] for s in stages) == whole and min(s["state_bytes"] for s in stages) > 0
    finally:
        one.stop()
        two.stop()
