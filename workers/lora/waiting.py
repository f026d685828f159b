"""Requests that wait inside the worker for an adapter slot, not at the client.

Design: with every `--max-loras` slot held by adapters in use, a request for another adapter is
admitted anyway and waits in the scheduler's queue with its adapter's name (`seq.lora_wait`), as
vLLM's scheduler keeps it. Each step the scheduler asks for a slot when it reaches the request
(`take_slot`) and, while none is free, skips it, keeping its place, so the requests behind it that
need no new slot still start. A slot frees when the last request of an adapter ends (the table then
gives it to the waiting one, least recently used first). Before, such a request was refused with a
429 and its client retried a second later: a cliff of seconds in time to first token as soon as
the adapters in use outnumber the slots. Trade-off: an adapter whose requests keep arriving keeps
its slot, so a waiting adapter starts when that adapter's stream of requests pauses (vLLM's rule
too); a request whose adapter is gone meanwhile (unloaded, its files unreadable) ends with an
error naming it.
"""

from __future__ import annotations

from workers.engine.events import ErrorEvent, deliver
from workers.kv.hashing import root_hash
from workers.lora.adapter import LoraAdapter, LoraError
from workers.lora.apply import lora_key
from workers.lora.table import LoraSlotsFull, LoraTable, acquire


def acquire_or_wait(table: LoraTable | None, name: str) -> LoraAdapter | None:
    """Adapter `name` held in a slot, or None while every slot is in use (the request then waits for
    one); raises `UnknownLora` for a name this worker does not serve."""
    try:
        return acquire(table, name)
    except LoraSlotsFull:
        return None


def attach(seq, name: str, adapter: LoraAdapter | None, model_root: bytes) -> None:
    """`seq` runs with `adapter` (held in a slot; its prefix-cache root mixes the adapter in), or, with
    None, waits for a slot for adapter `name`."""
    if adapter is None:
        seq.lora_wait = name
        return
    seq.lora, seq.lora_wait = adapter, None
    seq.cache_root = root_hash(model_root, *lora_key(adapter))


def take_slot(engine, seq) -> bool:
    """Whether `seq`, waiting for adapter `seq.lora_wait` in `engine`'s queue, now holds it in a slot
    (bound to it). False while every slot is in use; a request whose adapter cannot be had any more
    gets an error with the reason (once) and stays out of the batch until its abort, queued, ends it."""
    if seq.finish_reason is not None:
        return False  # refused already: its abort is on the way
    try:
        adapter = engine.loras.acquire(seq.lora_wait)
    except LoraSlotsFull:
        return False
    except LoraError as e:
        seq.finish_reason = "error"
        deliver([(seq.stream, ErrorEvent(f"LoRA adapter `{seq.lora_wait}` can no longer be served: {e}"))])
        engine.abort(seq.request_id)
        return False
    attach(seq, seq.lora_wait, adapter, engine.scheduler.config.cache_root)
    return True
