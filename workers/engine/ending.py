"""Ending every request at once: a fatal step error or a shutdown.

Design: a shutdown moves its streams to other workers, so with `publish` the running sequences'
KV goes to the host tier first (workers/kvtier/publish.py) and is written before any error is
sent; the router only moves a stream once its error arrives, so the next worker always finds the
blocks. Requests still in the inbox (never seen by the scheduler) get the same error. Trade-off:
a shutdown waits for the tier's writer, paid once per worker that stops, never by a step.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

from workers.engine.events import ErrorEvent
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.kvtier.publish import publish as publish_kv


def end_every_request(scheduler: Scheduler, tier, inbox: queue.SimpleQueue, add_kind: str,
                      release: Callable[[Sequence], None], message: str, publish: bool) -> list:
    """Abort and release every running, waiting and queued request; returns the (stream, error)
    pairs to deliver. With `publish` and a tier that is on, the running sequences' KV is written
    to the tier first and each error says how many tokens of it the tier holds."""
    items = []
    running = list(scheduler.running)
    kv_tokens = dict(zip(map(id, running), publish_kv(scheduler.kv, running).tokens, strict=True)) \
        if publish and tier is not None and tier.enabled else {}
    for seq in running + list(scheduler.waiting):
        scheduler.abort_request(seq.request_id)
        release(seq)
        held = kv_tokens.get(id(seq), 0)
        note = f" (its KV cache, {held} tokens, is in the host KV tier)" if held else ""
        items.append((seq.stream, ErrorEvent(message + note)))
    while True:  # requests submitted but never seen by the scheduler
        try:
            kind, value = inbox.get_nowait()
        except queue.Empty:
            break
        if kind == add_kind:
            release(value)
            items.append((value.stream, ErrorEvent(message)))
    return items
