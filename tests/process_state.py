"""Per-process state a worker keeps for its whole life (its bound device, its fp8 convention),
reset here between tests that each play a new process. Test-only: production code never
unbinds a device or unlocks a convention."""

from __future__ import annotations


def unbind_device() -> None:
    """Forget the bound device and the capability memo, as a fresh process would have."""
    from workers.device import bind

    with bind._bind_lock:
        bind._bound = None
        bind._capability_by_index.clear()


def unlock_fp8() -> None:
    """Forget the fp8 convention this process locked."""
    from workers.quant import fp8_convention as convention

    with convention._lock:
        convention._locked = None


def locked_fp8():
    """The fp8 convention this process locked (None before any)."""
    from workers.quant import fp8_convention as convention

    return convention._locked
