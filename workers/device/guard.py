"""The one device guard: every scoped device switch in hetserve goes through `device_guard`,
and the worker's one permanent switch (its binding) through `bind_current_device`.

Design: the guard remembers the caller's device on entry and restores it on exit whenever the
caller asked for a different device, whether or not the switch reported success (one that raised
half-way may still have changed it); it refuses a negative or absent index before touching
anything, and one guard entered several times switches on the first entry and restores once, on
the last exit. The device primitives come from a small `Platform` (CUDA through torch, or an
in-memory one for simulated hosts and tests). Trade-off: a restore on every exit that asked for
another device, even one whose switch failed, costs a device call to never leave one changed."""

from __future__ import annotations

import threading
from typing import Protocol


class InvalidDeviceIndexError(ValueError):
    """A guard was asked for a negative or absent device index; the device was left alone."""


class Platform(Protocol):
    def device_count(self) -> int: ...
    def current_device(self) -> int: ...
    def set_device(self, index: int) -> None: ...


class CudaPlatform:
    """torch.cuda's device primitives."""

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count()

    def current_device(self) -> int:
        import torch

        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        import torch

        torch.cuda.set_device(index)


class SimulatedPlatform:
    """An in-memory current device for simulated hosts and tests."""

    def __init__(self, count: int = 1, current: int = 0):
        self.count = count
        self.current = current
        self.switches: list[int] = []  # every set_device call, in order

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        self.switches.append(index)
        self.current = index


def default_platform() -> Platform:
    import torch

    return CudaPlatform() if torch.cuda.is_available() else SimulatedPlatform(count=1)


def _checked_index(index, platform: Platform) -> int:
    """`index` if it names a device this process sees; `InvalidDeviceIndexError` otherwise."""
    if index is None or isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise InvalidDeviceIndexError(f"Device index `{index}` is invalid: expected an integer >= 0")
    count = platform.device_count()
    if index >= count:
        raise InvalidDeviceIndexError(
            f"Device index `{index}` is absent: this process sees {count} device(s) (0..{count - 1})"
        )
    return index


def bind_current_device(index: int, platform: Platform | None = None) -> None:
    """The worker's binding: `index` becomes the current device for the rest of the process and is
    never restored. The only device switch outside `device_guard`, validated the same way."""
    platform = platform if platform is not None else default_platform()
    platform.set_device(_checked_index(index, platform))


class device_guard:  # noqa: N801 - used like a function: `with device_guard(i):`
    """`with device_guard(i):` runs the block on device `i` and restores the caller's device."""

    def __init__(self, index: int | None, platform: Platform | None = None):
        self.index = index
        self.platform = platform if platform is not None else default_platform()
        self._lock = threading.RLock()
        self._depth = 0
        self._restore_to: int | None = None

    def __enter__(self) -> device_guard:
        with self._lock:
            if self._depth == 0:
                index = _checked_index(self.index, self.platform)  # raises before any device is touched
                previous = self.platform.current_device()
                # Restore is owed because the caller asked for a different device, not because
                # the switch succeeded: remember it before switching.
                self._restore_to = previous if index != previous else None
                if self._restore_to is not None:
                    try:
                        self.platform.set_device(index)
                    except BaseException:
                        self._restore()
                        raise
            self._depth += 1
            return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._restore()

    def _restore(self) -> None:
        target, self._restore_to = self._restore_to, None
        if target is not None:
            self.platform.set_device(target)
