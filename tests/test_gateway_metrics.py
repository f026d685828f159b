"""The gauges inference gateways scrape: live in each worker, per worker and per pod at the router.

The Gateway API Inference Extension's endpoint picker reads, per model server, the queued
and running requests and the KV cache utilization (0..1) under vLLM's names by default.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from server.fleet.metrics import merge_worker_metrics
from tests.engine_fakes import FakeRunner, tokenizer
from tests.test_router_units import _handles
from workers.contract import CapabilityPayload
from workers.engine.core import Engine
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.sampling.params import SamplingParams

GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc")


def _values(text: str) -> dict[str, float]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(families[name].type == "gauge" for name in GAUGES), {n: families[n].type for n in GAUGES}
    return {name: families[name].samples[0].value for name in GAUGES}


def test_worker_gauges_follow_the_engine_between_steps():
    """Read at scrape time: queued before the first step, running after it, free again after an abort."""
    tok = tokenizer()
    engine = Engine(FakeRunner(block_size=32), Scheduler(SchedulerConfig(2, 64, num_blocks=2, block_size=32)), tok,
                    max_queue=4)
    ids = tok.encode("Hello").ids
    streams = [engine.submit(ids, SamplingParams(max_new_tokens=20)) for _ in range(3)]
    assert _values(engine.metrics.render().decode()) == {
        "vllm:num_requests_waiting": 3, "vllm:num_requests_running": 0,
        "vllm:kv_cache_usage_perc": 0.0, "vllm:gpu_cache_usage_perc": 0.0}
    engine.step()  # two of the three take the pool's two KV blocks
    assert _values(engine.metrics.render().decode()) == {
        "vllm:num_requests_waiting": 1, "vllm:num_requests_running": 2,
        "vllm:kv_cache_usage_perc": 1.0, "vllm:gpu_cache_usage_perc": 1.0}
    engine.abort(streams[0].request_id)
    engine._drain_inbox()  # the engine thread's next look at its inbox, without a step
    values = _values(engine.metrics.render().decode())
    assert values["vllm:num_requests_running"] == 1 and values["vllm:kv_cache_usage_perc"] == 0.5


def test_router_serves_each_workers_gauges_and_the_pods_totals_last():
    hs = _handles("sm_80,sm_90")
    hs[0].info = CapabilityPayload(capacity={"max_tokens": 1000})
    hs[1].info = CapabilityPayload(capacity={"kv_blocks_total": 250, "kv_block_size": 16})  # 4000 tokens
    text = ("# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting {w}\n"
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {r}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {kv}\n")
    merged = merge_worker_metrics([(hs[0], text.format(w=2, r=4, kv=1.0)), (hs[1], text.format(w=1, r=3, kv=0.25))])
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    samples = {name: [(s.labels["worker_id"], s.labels["capability"], s.value) for s in families[name].samples]
               for name in GAUGES[:3]}
    assert samples["vllm:num_requests_waiting"] == [("gpu0", "8.0", 2), ("gpu1", "9.0", 1), ("all", "all", 3)]
    assert samples["vllm:num_requests_running"] == [("gpu0", "8.0", 4), ("gpu1", "9.0", 3), ("all", "all", 7)]
    # the pod's KV usage: used tokens over all tokens, (1.0 * 1000 + 0.25 * 4000) / 5000
    assert samples["vllm:kv_cache_usage_perc"][-1] == ("all", "all", 0.4)
