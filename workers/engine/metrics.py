"""This worker's own Prometheus series (the router adds worker id and capability labels).

Design: one `CollectorRegistry` per `WorkerMetrics`, never the global one, so a test process can
build several workers and the text holds only this worker's series. The engine thread updates
counters once per request event and once per step; the HTTP side only renders. The gauges
Kubernetes inference gateways scrape (vLLM's names, which the Gateway API Inference Extension's
endpoint picker reads) are read from the engine at scrape time (`track()`), so they are never
stale between engine steps. Trade-off: a registry per worker instead of the process's default
one, so nothing registered globally (a library's own series) shows in this worker's text."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from workers.contract import GATEWAY_KV_USAGE, GATEWAY_RUNNING, GATEWAY_WAITING

PREFIX = "hetserve_worker"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# the moments of `step_moments` (`np`: steps that computed prompt tokens)
STEP_MOMENTS = ("n", "p", "b", "pp", "bb", "pb", "y", "py", "by", "np")


class GatewayGauges:
    """The inference gateways' gauges, and this worker's own KV usage ratio, read from the
    engine when scraped."""

    def __init__(self, load: Callable[[], tuple[int, int]], kv_usage: Callable[[], float]):
        self._load, self._kv_usage = load, kv_usage

    def collect(self):
        running, queued = self._load()
        yield GaugeMetricFamily(GATEWAY_WAITING, "Requests waiting to be scheduled.", value=queued)
        yield GaugeMetricFamily(GATEWAY_RUNNING, "Requests in the running batch.", value=running)
        usage = self._kv_usage()
        for name in GATEWAY_KV_USAGE:
            yield GaugeMetricFamily(name, "Fraction of the KV cache in use (1 = full).", value=usage)
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_usage_ratio", "Fraction of KV cache blocks held by running "
                                "sequences (cached prefix blocks nobody holds count as free)", value=usage)


class StepMoments:
    """`hetserve_worker_step_moments_total{moment}`: the per-step sums of `STEP_MOMENTS`, kept as
    floats the engine thread adds to (no lock per step) and read when scraped."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(STEP_MOMENTS, 0.0)

    def add(self, p: float, b: float, y: float) -> None:
        s = self.sums
        s["n"] += 1.0
        s["p"] += p
        s["b"] += b
        s["pp"] += p * p
        s["bb"] += b * b
        s["pb"] += p * b
        s["y"] += y
        s["py"] += p * y
        s["by"] += b * y
        s["np"] += 1.0 if p else 0.0

    def collect(self):
        family = CounterMetricFamily(f"{PREFIX}_step_moments", "Per-step sums for a least-squares fit of step "
                                     "time (y seconds) over prompt tokens computed (p) and sequences (b): "
                                     + ", ".join(STEP_MOMENTS), labels=["moment"])
        for m, v in list(self.sums.items()):
            family.add_metric([m], v)
        yield family


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._tracking = False
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Requests finished, by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter(f"{PREFIX}_rejected_requests", "Requests refused, by reason", ["reason"], registry=r)
        self.prefill_tokens = Counter(
            f"{PREFIX}_prefill_tokens", "Prompt tokens computed, or skipped because the prefix cache held them",
            ["kind"], registry=r,
        )
        for kind in ("computed", "skipped"):
            self.prefill_tokens.labels(kind)
        self.prefix_queries = Counter(
            f"{PREFIX}_prefix_cache_queries_tokens", "Tokens of admitted sequences looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hits = Counter(
            f"{PREFIX}_prefix_cache_hits_tokens", "Tokens found in the prefix cache (not computed again)", registry=r
        )
        self.preemptions = Counter(
            f"{PREFIX}_preemptions", "Running sequences preempted for KV blocks (recomputed later)", registry=r
        )
        self.generated_tokens = Counter(f"{PREFIX}_generated_tokens", "Tokens generated", registry=r)
        self.steps = Counter(f"{PREFIX}_engine_steps", "Engine steps run", registry=r)
        self.embedded = Counter(f"{PREFIX}_embedding_inputs", "Texts embedded (each a forward beside the steps)",
                                registry=r)
        self.running = Gauge(f"{PREFIX}_running_requests", "Sequences in the running batch", registry=r)
        self.queued = Gauge(f"{PREFIX}_queued_requests", "Requests accepted and waiting", registry=r)
        self.kernel_fallbacks = Gauge(
            f"{PREFIX}_kernel_fallback", "Layers whose chosen kernel failed on this device (self-test, build or "
            "compile) and run their torch path instead (1), with the reason", ["layer", "reason"], registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            f"{PREFIX}_request_duration_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.step_seconds = Histogram(
            f"{PREFIX}_step_seconds", "Duration of one engine step", buckets=_STEP_BUCKETS, registry=r
        )
        # vLLM's speculative decoding counters (names as vLLM exports them)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Decode rows that carried draft tokens",
                                   registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=r)
        self.spec_k = Gauge(f"{PREFIX}_spec_decode_k", "Draft tokens per decode row chosen at the latest "
                            "speculative choice (0: plain decoding)", registry=r)
        self.spec_decisions = Counter(f"{PREFIX}_spec_decode_decisions", "Steps by the cause of their speculative "
                                      "choice (workers/spec/policy.py)", ["cause"], registry=r)
        self.batch_size = Histogram(
            f"{PREFIX}_batch_size", "Sequences in one engine step", buckets=_BATCH_BUCKETS, registry=r
        )
        # each step's (1, P prompt tokens computed, B sequences, y seconds) summed into the moments of a
        # least-squares fit y = c + a*P + b*B, so the router can fit each phase's cost over steps, not
        # over its sampling intervals (server/routing/phases.py); plain floats, rendered when scraped
        self.step_moments = StepMoments()
        r.register(self.step_moments)

    def on_step(self, seconds: float, batch: int, out, new_tokens: int) -> None:
        """One engine step; `out` is its `SchedulerOutput` (prefill and prefix-cache figures)."""
        self.steps.inc()
        self.step_seconds.observe(seconds)
        self.batch_size.observe(batch)
        self.step_moments.add(float(out.num_prefill_tokens), float(batch), seconds)
        if out.num_prefill_tokens:
            self.prefill_tokens.labels("computed").inc(out.num_prefill_tokens)
        if out.num_queried_tokens:
            self.prefix_queries.inc(out.num_queried_tokens)
        if out.num_cached_tokens:
            self.prefix_hits.inc(out.num_cached_tokens)
            self.prefill_tokens.labels("skipped").inc(out.num_cached_tokens)
        if out.preempted:
            self.preemptions.inc(len(out.preempted))
        self.generated_tokens.inc(new_tokens)

    def fell_back(self, failed: dict[str, str]) -> None:
        """Each layer (-> why) whose kernel failed on this device, now on its torch path."""
        for layer, why in failed.items():
            self.kernel_fallbacks.labels(layer, why[:200]).set(1)

    def set_load(self, running: int, queued: int) -> None:
        self.running.set(running)
        self.queued.set(queued)

    def track(self, load: Callable[[], tuple[int, int]], kv_usage: Callable[[], float]) -> None:
        """Serve the gateway gauges from these readers (once per registry)."""
        if not self._tracking:
            self.registry.register(GatewayGauges(load, kv_usage))
            self._tracking = True

    def render(self) -> bytes:
        return generate_latest(self.registry)
