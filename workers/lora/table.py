"""The worker's adapters: every name it may serve, at most `max_loras` of them on the device (one pool
slot each), and the host copies of the last `max_cpu_loras` read.

Design: `--lora NAME=DIR` registers a name; `acquire(name)` returns the adapter in its slot and
counts the request using it; `release` ends that use. An adapter not in a slot is copied in from
its host copy when one is kept, else read (and checked) from its directory into a host copy first;
when every slot is taken, the least recently used adapter that no request uses leaves its slot (its
host copy stays, so its next request costs a copy, not a disk read). The host copies are an LRU of
their own, bounded by `max_cpu_loras` (at least `max_loras`). With every slot in use the request is
refused with the reason rather than evicting weights a running row needs. `place(adapter, slot)`
(workers/lora/pool.py `LoraPool.write`) puts a host copy in a slot; without it the host copy is
served as read. Trade-off: slots and host copies count adapters, not bytes: ranks up to
`max_lora_rank` bound each one.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workers.lora.adapter import LoraAdapter, LoraError

logger = logging.getLogger(__name__)


class LoraSlotsFull(LoraError):
    """Every slot holds an adapter some request is using (retry later)."""


class UnknownLora(LoraError):
    """A name this worker does not serve."""


class LoraInUse(LoraError):
    """An adapter that requests still run with (unload it when they end)."""


@dataclass(frozen=True)
class LoraInfo:
    """What `/health` and the router see of one registered adapter."""

    name: str
    path: str
    loaded: bool  # in a slot on the device
    running: int
    slot: int | None = None
    on_host: bool = False  # a host copy is kept (a load from host memory, not from disk)


@dataclass(frozen=True)
class PoolStats:
    """The slots and the host tier, and how adapters moved between disk, host and device."""

    max_loras: int
    max_cpu_loras: int
    on_device: int
    on_host: int
    loads_from_disk: int
    loads_from_host: int
    device_evictions: int
    host_evictions: int


class LoraTable:
    def __init__(self, read: Callable[[str, Path], LoraAdapter], max_loras: int,
                 place: Callable[[LoraAdapter, int], LoraAdapter] | None = None,
                 max_cpu_loras: int | None = None) -> None:  # fmt: skip
        """`read(name, dir)` reads and checks one adapter into host memory (workers/lora/adapter.py's
        `read_adapter` bound to the model); `max_loras` adapters may be in slots at once, placed there
        by `place(adapter, slot)`; `max_cpu_loras` host copies are kept (default: `max_loras`)."""
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if max_loras < 1:
            raise ValueError(f"`--max-loras` must be an integer >= 1, got `{max_loras}`")
        if max_cpu_loras < max_loras:
            raise ValueError(f"`--max-cpu-loras` must be >= `--max-loras` ({max_loras}), got `{max_cpu_loras}`")
        self._read, self.max_loras, self.max_cpu_loras = read, max_loras, max_cpu_loras
        self._place = place or (lambda adapter, slot: adapter)
        self._paths: dict[str, Path] = {}
        self._held: OrderedDict[str, LoraAdapter] = OrderedDict()  # in a slot, least recently used first
        self._slot: dict[str, int] = {}
        self._free = list(range(max_loras - 1, -1, -1))  # slots nobody holds (popped from the end: 0 first)
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # host copies, least recently used first
        self._users: dict[str, int] = {}
        self._moves = {"disk": 0, "host": 0, "device_evictions": 0, "host_evictions": 0}
        self._lock = threading.RLock()  # the HTTP side registers and acquires, the engine thread releases

    # ---- names ----------------------------------------------------------------------------
    def register(self, name: str, path: str | Path, load: bool = True) -> LoraAdapter | None:
        """Serve `name` from `path`; with `load`, read it now (a bad adapter fails here, by name) and place
        it in a slot when one can be had (with every slot in use it waits in host memory)."""
        if not name or any(c in name for c in "= \t\n"):
            raise LoraError(f"LoRA name `{name}` is not a plain name. Accepted: `--lora NAME=DIR`, NAME without "
                            f"spaces or `=`")
        if name in self._paths:
            raise LoraError(f"LoRA adapter `{name}` is already loaded. Accepted: a new name, or unload it first")
        path = Path(path)
        with self._lock:
            if not load:
                self._paths[name] = path
                return None
            adapter = self._from_disk(name, path)
            self._paths[name] = path
            try:
                return self._hold(name, adapter)
            except LoraSlotsFull:  # read and checked; it takes a slot when a request asks for it
                return adapter

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self._paths:
                raise UnknownLora(self._unknown(name))
            if self._users.get(name):
                raise LoraInUse(f"LoRA adapter `{name}` is in use by {self._users[name]} requests; unload it when "
                                f"they end")
            del self._paths[name]
            self._drop(name)
            self._host.pop(name, None)
            self._users.pop(name, None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._paths)

    def __contains__(self, name: str) -> bool:
        return name in self._paths

    def describe(self) -> list[LoraInfo]:
        with self._lock:
            return [LoraInfo(n, str(p), n in self._held, self._users.get(n, 0), self._slot.get(n), n in self._host)
                    for n, p in self._paths.items()]

    def stats(self) -> PoolStats:
        with self._lock:
            m = self._moves
            return PoolStats(self.max_loras, self.max_cpu_loras, len(self._held), len(self._host), m["disk"],
                             m["host"], m["device_evictions"], m["host_evictions"])

    # ---- use -------------------------------------------------------------------------------
    def acquire(self, name: str) -> LoraAdapter:
        """The adapter `name`, held in memory and counted as used until `release(name)`."""
        with self._lock:
            if name not in self._paths:
                raise UnknownLora(self._unknown(name))
            adapter = self._held.get(name)
            if adapter is None:
                host = self._host.get(name)
                if host is None:
                    host = self._from_disk(name, self._paths[name])
                else:
                    self._host.move_to_end(name)
                    self._moves["host"] += 1
                adapter = self._hold(name, host)
            else:
                self._held.move_to_end(name)
            self._users[name] = self._users.get(name, 0) + 1
            return adapter

    def release(self, name: str) -> None:
        with self._lock:
            left = self._users.get(name, 0) - 1
            assert left >= 0, f"LoRA adapter {name} released more often than acquired"
            self._users[name] = left

    def _from_disk(self, name: str, path: Path) -> LoraAdapter:
        """Read `name` from `path` into a host copy (the least recently used copy beyond the bound goes)."""
        adapter = self._read(name, path)
        self._moves["disk"] += 1
        self._host[name] = adapter
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            gone, _ = self._host.popitem(last=False)
            self._moves["host_evictions"] += 1
            logger.info("LoRA adapter %s leaves host memory (least recently used; %s kept)", gone,
                        self.max_cpu_loras)
        return adapter

    def _hold(self, name: str, host: LoraAdapter) -> LoraAdapter:
        """`host` placed in a slot (the least recently used idle adapter leaves one when none is free)."""
        if not self._free:
            idle = next((n for n in self._held if not self._users.get(n)), None)
            if idle is None:
                raise LoraSlotsFull(f"All {self.max_loras} LoRA slots (`--max-loras`) hold adapters in use "
                                    f"({', '.join(self._held)}); `{name}` can load when one is free")
            logger.info("LoRA adapter %s leaves its slot (least recently used; %s slots)", idle, self.max_loras)
            self._drop(idle)
            self._moves["device_evictions"] += 1
        slot = self._free.pop()
        try:
            adapter = self._place(host, slot)
        except BaseException:
            self._free.append(slot)
            raise
        self._held[name], self._slot[name] = adapter, slot
        return adapter

    def _drop(self, name: str) -> None:
        if self._held.pop(name, None) is not None:
            self._free.append(self._slot.pop(name))

    def _unknown(self, name: str) -> str:
        return f"LoRA adapter `{name}` is not served here. Served: {', '.join(self._paths) or 'none'}"


def acquire(table: LoraTable | None, name: str) -> LoraAdapter:
    """`table.acquire(name)`, or the named error of a worker that serves no adapters."""
    if table is None:
        raise UnknownLora(f"LoRA adapter `{name}` is not served here: this worker serves no adapters "
                          f"(start it with `--lora NAME=DIR`)")
    return table.acquire(name)
