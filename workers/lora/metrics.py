"""What a worker says about its adapters: vLLM's `vllm:lora_requests_info` gauge and the
`/health` entry the router shows in `/workers`.

Design: the engine thread, after each step, records which adapters its running and waiting
sequences use (`LoraLoad`, one frozen value swapped whole), and the scrape reads that value, so
the HTTP side never walks the scheduler's queues while the engine changes them. The gauge keeps
vLLM's shape, which the Gateway API inference extension's LoRA affinity reads: labels
`running_lora_adapters` and `waiting_lora_adapters` (names joined by `,`) and `max_lora`, value
the time it was last set. Trade-off: the figures are as fresh as the last step (a request still
in the engine's inbox counts once the next step sees it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily

from workers.contract import GATEWAY_LORA_INFO as LORA_INFO


@dataclass(frozen=True)
class LoraLoad:
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    at: float = 0.0


def lora_load(scheduler) -> LoraLoad:
    """The adapters (distinct, sorted) of the scheduler's running and waiting sequences, now."""
    def names(seqs) -> tuple[str, ...]:
        return tuple(sorted({s.lora.name for s in seqs if s.lora is not None}))

    return LoraLoad(names(scheduler.running), names(scheduler.waiting), time.time())


class LoraGauge:
    """`vllm:lora_requests_info` of one engine (registered beside its other gauges)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def collect(self):
        table, load = self._engine.loras, self._engine.lora_load
        if table is None:
            return
        family = GaugeMetricFamily(LORA_INFO, "Running stats on LoRA requests.",
                                   labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        family.add_metric([",".join(load.running), ",".join(load.waiting), str(table.max_loras)],
                          load.at or time.time())
        yield family


def describe_loras(table, load: LoraLoad) -> dict | None:
    """`/health` `loras`: the slots, each adapter served (loaded in memory or not, requests using
    it), and those of running and waiting requests."""
    if table is None:
        return None
    return {"max_loras": table.max_loras, "running": list(load.running), "waiting": list(load.waiting),
            "adapters": [{"name": i.name, "path": i.path, "loaded": i.loaded, "requests": i.running}
                         for i in table.describe()]}
