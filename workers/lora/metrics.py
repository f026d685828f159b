"""What a worker says about its adapters: vLLM's `vllm:lora_requests_info` gauge and the
`/health` entry the router shows in `/workers`.

Design: the engine thread, after each step, records which adapters its running and waiting
sequences use (`LoraLoad`, one frozen value swapped whole), and the scrape reads that value, so
the HTTP side never walks the scheduler's queues while the engine changes them. The gauge keeps
vLLM's shape, which the Gateway API inference extension's LoRA affinity reads: labels
`running_lora_adapters` and `waiting_lora_adapters` (names joined by `,`) and `max_lora`, value
the time it was last set. Beside it, how adapters reach the pool's slots (`{PREFIX}_lora_loads_total`
by `source`: `disk` or `host`) and leave them (`{PREFIX}_lora_evictions_total` by `tier`: `device`
slot or `host` copy), and the adapters each tier holds. Trade-off: the figures are as fresh as the
last step (a request still in the engine's inbox counts once the next step sees it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from workers.contract import GATEWAY_LORA_INFO as LORA_INFO
from workers.engine.metrics import PREFIX


@dataclass(frozen=True)
class LoraLoad:
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    at: float = 0.0


def lora_load(scheduler) -> LoraLoad:
    """The adapters (distinct, sorted) of the scheduler's running and waiting sequences, now."""
    def names(seqs) -> tuple[str, ...]:
        return tuple(sorted({s.lora.name if s.lora is not None else s.lora_wait for s in seqs
                             if s.lora is not None or s.lora_wait is not None}))

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
        stats = table.stats()
        loads = CounterMetricFamily(f"{PREFIX}_lora_loads", "LoRA adapters placed in a slot, by where they came "
                                    "from (disk: read and checked; host: copied from host memory)", labels=["source"])
        loads.add_metric(["disk"], stats.loads_from_disk)
        loads.add_metric(["host"], stats.loads_from_host)
        yield loads
        evictions = CounterMetricFamily(f"{PREFIX}_lora_evictions", "LoRA adapters evicted (least recently used), "
                                        "from a device slot or from host memory", labels=["tier"])
        evictions.add_metric(["device"], stats.device_evictions)
        evictions.add_metric(["host"], stats.host_evictions)
        yield evictions
        held = GaugeMetricFamily(f"{PREFIX}_lora_adapters", "LoRA adapters held, by tier", labels=["tier"])
        held.add_metric(["device"], stats.on_device)
        held.add_metric(["host"], stats.on_host)
        yield held


def describe_loras(table, load: LoraLoad) -> dict | None:
    """`/health` `loras`: the slots, each adapter served (in a slot or not, its host copy, requests
    using it), those of running and waiting requests, and the pool (`pool`: slots and host copies
    held, loads from disk and from host, evictions)."""
    if table is None:
        return None
    stats = table.stats()
    pool = {"slots": stats.max_loras, "on_device": stats.on_device, "host_slots": stats.max_cpu_loras,
            "on_host": stats.on_host, "loads_from_disk": stats.loads_from_disk,
            "loads_from_host": stats.loads_from_host, "device_evictions": stats.device_evictions,
            "host_evictions": stats.host_evictions}
    return {"max_loras": table.max_loras, "running": list(load.running), "waiting": list(load.waiting),
            "pool": pool,
            "adapters": [{"name": i.name, "path": i.path, "loaded": i.loaded, "slot": i.slot, "on_host": i.on_host,
                          "requests": i.running} for i in table.describe()]}
