"""The worker's adapters: every name it may serve, and at most `max_loras` of them in memory.

Design: `--lora NAME=DIR` registers a name; `acquire(name)` returns the adapter read onto the
model (reading it from its directory when it is not held) and counts the request using it;
`release` ends that use. When a read would exceed `max_loras` slots, the least recently used
adapter that no request uses is dropped (it is read again from disk when asked for); with every
slot in use the request is refused with the reason rather than evicting weights a running row
needs. Trade-off: a dropped adapter costs a disk read on its next request (no host-memory tier
yet), and the slots count adapters, not bytes: ranks up to `max_lora_rank` bound each one.
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
    loaded: bool
    running: int


class LoraTable:
    def __init__(self, read: Callable[[str, Path], LoraAdapter], max_loras: int) -> None:
        """`read(name, dir)` reads and checks one adapter (workers/lora/adapter.py's `read_adapter`
        bound to the model); `max_loras` adapters may be held at once."""
        if max_loras < 1:
            raise ValueError(f"`--max-loras` must be an integer >= 1, got `{max_loras}`")
        self._read, self.max_loras = read, max_loras
        self._paths: dict[str, Path] = {}
        self._held: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._users: dict[str, int] = {}
        self._lock = threading.RLock()  # the HTTP side registers and acquires, the engine thread releases

    # ---- names ----------------------------------------------------------------------------
    def register(self, name: str, path: str | Path, load: bool = True) -> LoraAdapter | None:
        """Serve `name` from `path`; with `load`, read it now (a bad adapter fails here, by name)."""
        if not name or any(c in name for c in "= \t\n"):
            raise LoraError(f"LoRA name `{name}` is not a plain name. Accepted: `--lora NAME=DIR`, NAME without "
                            f"spaces or `=`")
        if name in self._paths:
            raise LoraError(f"LoRA adapter `{name}` is already loaded. Accepted: a new name, or unload it first")
        path = Path(path)
        with self._lock:
            adapter = self._read(name, path) if load else None
            self._paths[name] = path
            if adapter is not None:
                self._hold(name, adapter)
            return adapter

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self._paths:
                raise UnknownLora(self._unknown(name))
            if self._users.get(name):
                raise LoraInUse(f"LoRA adapter `{name}` is in use by {self._users[name]} requests; unload it when "
                                f"they end")
            del self._paths[name]
            self._held.pop(name, None)
            self._users.pop(name, None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._paths)

    def __contains__(self, name: str) -> bool:
        return name in self._paths

    def describe(self) -> list[LoraInfo]:
        with self._lock:
            return [LoraInfo(n, str(p), n in self._held, self._users.get(n, 0)) for n, p in self._paths.items()]

    # ---- use -------------------------------------------------------------------------------
    def acquire(self, name: str) -> LoraAdapter:
        """The adapter `name`, held in memory and counted as used until `release(name)`."""
        with self._lock:
            if name not in self._paths:
                raise UnknownLora(self._unknown(name))
            adapter = self._held.get(name)
            if adapter is None:
                adapter = self._hold(name, self._read(name, self._paths[name]))
            else:
                self._held.move_to_end(name)
            self._users[name] = self._users.get(name, 0) + 1
            return adapter

    def release(self, name: str) -> None:
        with self._lock:
            left = self._users.get(name, 0) - 1
            assert left >= 0, f"LoRA adapter {name} released more often than acquired"
            self._users[name] = left

    def _hold(self, name: str, adapter: LoraAdapter) -> LoraAdapter:
        while len(self._held) >= self.max_loras:
            idle = next((n for n in self._held if not self._users.get(n)), None)
            if idle is None:
                raise LoraSlotsFull(f"All {self.max_loras} LoRA slots (`--max-loras`) hold adapters in use "
                                    f"({', '.join(self._held)}); `{name}` can load when one is free")
            logger.info("LoRA adapter %s leaves memory (least recently used; %s slots)", idle, self.max_loras)
            del self._held[idle]
        self._held[name] = adapter
        return adapter

    def _unknown(self, name: str) -> str:
        return f"LoRA adapter `{name}` is not served here. Served: {', '.join(self._paths) or 'none'}"


def acquire(table: LoraTable | None, name: str) -> LoraAdapter:
    """`table.acquire(name)`, or the named error of a worker that serves no adapters."""
    if table is None:
        raise UnknownLora(f"LoRA adapter `{name}` is not served here: this worker serves no adapters "
                          f"(start it with `--lora NAME=DIR`)")
    return table.acquire(name)
