"""The capability cross-check: does the `kernels` library compute the bound device's capability?

Design: `kernels` picks CUDA kernels through its private `_find_capability()`, a process-wide
`lru_cache` over the current device's capability. A worker binds its one device first, so both
answers should agree; if not (a read before binding, a stale cache), `kernels` would choose for
another device. On a real GPU the worker compares them before kernelizing and refuses to become
ready on a mismatch (`KernelCapabilityMismatchError`); simulated devices and CPUs have nothing to
check. Trade-off: this module imports a private function, the only one that does, so a change in
the library breaks here and nowhere else."""

from __future__ import annotations

from workers.device.bind import BoundDevice


class KernelCapabilityMismatchError(RuntimeError):
    """`kernels`' own capability lookup disagrees with the bound device: its kernels would be
    chosen for another device than the one this worker serves."""


def check_kernels_capability(dev: BoundDevice) -> tuple[bool, str]:
    """Does the `kernels` library's own capability lookup agree with the bound device?

    `kernels` selects CUDA kernels through `_find_capability()`, an `lru_cache` over the current
    device. On a real GPU the worker refuses to become ready if that answer differs from its own.
    """
    if not dev.is_real_gpu or dev.type != "cuda":
        return True, f"no real CUDA device ({'simulated ' if dev.simulated else ''}{dev.type}): nothing to cross-check"
    from kernels.layer.repos import _find_capability

    theirs = _find_capability()
    ours = dev.capability.int if dev.capability else None
    if theirs != ours:
        return False, f"`kernels` computes capability {theirs}, the bound device has {ours}"
    return True, f"`kernels` capability {theirs} matches the bound device"


def refuse_on_mismatch(dev: BoundDevice) -> str:
    """The cross-check's reason when the answers agree; `KernelCapabilityMismatchError` otherwise."""
    ok, why = check_kernels_capability(dev)
    if not ok:
        raise KernelCapabilityMismatchError(
            f"Refusing to kernelize for {dev.type} device {dev.index} (capability `{dev.capability_str}`): {why}"
        )
    return why
