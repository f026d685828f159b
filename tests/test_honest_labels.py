"""What the router shows is what runs: fp8 only where a layer computes in fp8, speeds only where
measured, integers as integers (issue 34's labels)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.core import CollectorRegistry
from prometheus_client.exposition import generate_latest

from server.config.settings import RouterSettings
from server.edge.app import ready_summary
from server.fleet.handle import WorkerHandle
from server.fleet.spec import build_worker_specs
from server.routing.metrics import RoutingCollector, speed_view
from server.routing.router import Router
from server.routing.speed import Speed, SpeedFit
from workers.contract import CapabilityPayload, CompileDescription, WorkerState, parse_simulate


def _handle(token: str, fp8: dict, dtype: str = "bfloat16") -> WorkerHandle:
    (spec,) = build_worker_specs(parse_simulate(token), RouterSettings(worker_command=("w",)), Path("/r"), 1,
                                 base_env={})
    h = WorkerHandle(spec, state=WorkerState.READY)
    h.info = CapabilityPayload(fp8=fp8, model={"dtype": dtype, "sampling_defaults": {"top_k": 40, "top_p": 0.9}})
    return h


class _Supervisor:
    def __init__(self, *handles):
        self.workers = {h.id: h for h in handles}


def test_fp8_not_used_reads_as_not_used_and_keeps_the_capability():
    """Guards `WorkerHandle.fp8_label` / `fp8_entry` (server/fleet/handle.py) and the ready line's
    `fp8: {h.fp8_label}` (server/edge/app.py `ready_summary`)."""
    h = _handle("sm_90", {"convention": "native_e4m3", "reason": "9.0 >= 8.9", "used": False,
                          "label": "not used (bfloat16)"})
    assert h.fp8_label == "not used (bfloat16)" and h.fp8_convention == "native_e4m3"  # the filter's key
    snap = h.snapshot(8)
    assert snap["fp8"]["used"] is False and snap["fp8"]["label"] == "not used (bfloat16)"
    assert snap["fp8"]["used_reason"] == "no `--quantize fp8` and no fp8 checkpoint: every layer computes in bfloat16"
    assert snap["device"]["fp8"] == {"convention": "native_e4m3", "reason": "9.0 >= 8.9"}
    assert ready_summary(_Supervisor(h)) == "gpu0 (9.0, fp8: not used (bfloat16))"
    used = _handle("sm_80", {"convention": "emulated", "reason": "8.0 < 8.9", "used": True, "label": "emulated"})
    assert ready_summary(_Supervisor(used)) == "gpu0 (8.0, fp8: emulated)"
    assert used.snapshot(8)["fp8"]["used_reason"] == "fp8 layers run emulated"


def test_sampling_defaults_keep_integers():
    """Guards `ModelDescription.sampling_defaults: dict[str, int | float]` (workers/contract/payload.py)."""
    model = _handle("sm_90", {})
    dumped = model.snapshot(8)["model"]["sampling_defaults"]
    assert dumped == {"top_k": 40, "top_p": 0.9} and type(dumped["top_k"]) is int


def test_a_speed_never_measured_is_unknown_not_a_billion_tokens_per_second():
    """Guards `prefill_tps` / `decode_tps` / `speed_view` (server/routing/metrics.py): a cost the fit
    clamps to its 1e-9 s floor is shown as None, a measured one as its tokens per second."""
    fit = SpeedFit()
    for _ in range(6):
        fit.observe(steps=100, prompt_tokens=50, generated_tokens=100, busy_s=0.5)
    measured = speed_view(fit.estimate())
    assert 100 < measured["decode_tokens_per_s"] < 1e6 and 100 < measured["prefill_tokens_per_s"] < 1e6
    view = speed_view(Speed(step_s=2e-3, prefill_s=1e-9, sequence_s=1e-9, samples=4))
    assert view["prefill_tokens_per_s"] is None and view["per_sequence_ms"] is None
    assert view["decode_tokens_per_s"] == 500.0 and view["step_ms"] == 2.0 and view["samples"] == 4
    view = speed_view(Speed(step_s=1e-9, prefill_s=1e-9, sequence_s=1e-9, samples=1))
    assert view["decode_tokens_per_s"] is None and view["decode_tokens_per_s_batch_8"] is None
    assert speed_view(None) is None


def test_metrics_leave_out_unmeasured_speeds():
    """Guards RoutingCollector's `if prefill_tps(speed) is not None` (server/routing/metrics.py)."""
    h = _handle("sm_90", {})
    router = Router(RouterSettings().routing)
    router.telemetry.speed = lambda wid: Speed(step_s=1e-3, prefill_s=1e-9, sequence_s=1e-4, samples=3)
    registry = CollectorRegistry()
    registry.register(RoutingCollector(router, lambda: [h]))
    text = generate_latest(registry).decode()
    assert "hetserve_router_worker_prefill_tokens_per_second{" not in text
    assert 'hetserve_router_worker_decode_tokens_per_second{batch="1"' in text


def test_workers_shows_the_compile_as_the_last_health_says_it_goes_on():
    """Guards `self.probe.compile` in `WorkerHandle.compile_entry`: a worker compiling its decode
    step behind its serving says so in `/health`, and `/workers` shows that, not what
    `/capability` said at start."""
    from server.fleet.probe import judge

    h = _handle("sm_90", {"convention": "native_e4m3"})
    h.info = h.info.model_copy(update={"compile": CompileDescription(mode="auto", enabled=True, backend="inductor",
                                                                     state="compiling", done=0, buckets=[1, 2])})
    assert h.snapshot(8)["compile"]["state"] == "compiling"
    health = {"status": "ready", "compile": {"mode": "auto", "enabled": True, "backend": "inductor",
                                             "state": "ready", "done": 2, "buckets": [1, 2], "seconds": 41.5}}
    h.probe = judge(200, health, 30.0)
    entry = h.snapshot(8)["compile"]
    assert (entry["state"], entry["done"], entry["seconds"]) == ("ready", 2, 41.5)


def test_workers_shows_what_is_still_prepared_and_each_fallback_as_the_last_health_says():
    """Guards `self.live(...)` in `WorkerHandle.snapshot`: what a worker still prepares behind its
    serving and the kernels on their torch paths are what its last `/health` said (the build and
    the compile go on after ready; a C++ build may fail behind the serving), else what
    `/capability` said at start."""
    from server.fleet.probe import judge

    h = _handle("sm_90", {"convention": "native_e4m3"})
    h.info = h.info.model_copy(update={"preparing": ["decode step: eager, compiling 1 of 6 buckets"],
                                       "fallbacks": {"RMSNorm": "self-test: max abs diff 0.5"}})
    entry = h.snapshot(8)
    assert entry["preparing"] == ["decode step: eager, compiling 1 of 6 buckets"]
    assert entry["fallbacks"] == {"RMSNorm": "self-test: max abs diff 0.5"}
    h.probe = judge(200, {"status": "ready", "preparing": ["decode step: eager, compiling 4 of 6 buckets"],
                          "fallbacks": {"RMSNorm": "self-test: max abs diff 0.5",
                                        "hetserve_cpu_greedy": "its C++ build failed: g++ exited 1"}}, 30.0)
    entry = h.snapshot(8)
    assert entry["preparing"] == ["decode step: eager, compiling 4 of 6 buckets"]
    assert entry["fallbacks"]["hetserve_cpu_greedy"] == "its C++ build failed: g++ exited 1"
    h.probe = judge(200, {"status": "ready", "preparing": [], "fallbacks": {}}, 30.0)  # all in use now
    assert h.snapshot(8)["preparing"] == [] and h.snapshot(8)["fallbacks"] == {}
    h.probe = judge(200, {"status": "ready"}, 30.0)  # a worker that does not say: what it said at start
    assert h.snapshot(8)["preparing"] == ["decode step: eager, compiling 1 of 6 buckets"]
