"""The one device guard, on a simulated platform and on real CUDA."""

from __future__ import annotations

import pytest
import torch

from workers.device.guard import InvalidDeviceIndexError, SimulatedPlatform, device_guard


class FailingPlatform(SimulatedPlatform):
    """A switch that changes the device and then raises (a half-done switch)."""

    def set_device(self, index: int) -> None:
        super().set_device(index)
        if len(self.switches) == 1:
            raise RuntimeError("driver error after the switch")


def test_switches_and_restores_the_callers_device():
    p = SimulatedPlatform(count=3, current=1)
    with device_guard(2, platform=p):
        assert p.current_device() == 2
    assert p.current_device() == 1
    assert p.switches == [2, 1]


def test_same_device_needs_no_switch():
    p = SimulatedPlatform(count=2, current=1)
    with device_guard(1, platform=p):
        assert p.current_device() == 1
    assert p.switches == []


def test_restores_even_when_the_switch_failed():
    """Guards `self._restore()` in the `except` branch around `set_device` in `__enter__`
    (with `_restore_to` recorded before the switch): the restore follows what the caller asked
    for, not whether the switch succeeded, so a switch that raised half-way still leaves the
    caller's device."""
    p = FailingPlatform(count=2, current=0)
    with pytest.raises(RuntimeError, match="driver error"):
        with device_guard(1, platform=p):
            pytest.fail("body must not run")
    assert p.current_device() == 0
    assert p.switches == [1, 0]


def test_restores_when_the_body_raises():
    p = SimulatedPlatform(count=2, current=0)
    with pytest.raises(KeyError):
        with device_guard(1, platform=p):
            raise KeyError("x")
    assert p.current_device() == 0


@pytest.mark.parametrize("bad", [-1, None, 5, True, "1"])
def test_refuses_negative_absent_or_non_integer_index_and_leaves_device_alone(bad):
    """Guards `index = self._validate()` running before `current_device`/`set_device`."""
    p = SimulatedPlatform(count=2, current=1)
    with pytest.raises(InvalidDeviceIndexError, match=f"`{bad}`"):
        with device_guard(bad, platform=p):
            pass
    assert p.current_device() == 1 and p.switches == []


def test_nested_and_reentered_use_restores_exactly_once():
    """Guards the `self._depth` counter: re-entering one guard object must not re-save the
    already-switched device as the one to restore, and restores once, on the last exit."""
    p = SimulatedPlatform(count=3, current=0)
    g = device_guard(2, platform=p)
    with g:
        with g:
            assert p.current_device() == 2
        assert p.current_device() == 2  # inner exit does not restore
    assert p.current_device() == 0
    assert p.switches == [2, 0]
    # re-entering the same guard later works again
    with g:
        assert p.current_device() == 2
    assert p.current_device() == 0 and p.switches == [2, 0, 2, 0]


def test_nested_different_guards_each_restore_their_caller():
    p = SimulatedPlatform(count=3, current=0)
    with device_guard(1, platform=p):
        with device_guard(2, platform=p):
            assert p.current_device() == 2
        assert p.current_device() == 1
    assert p.current_device() == 0


@pytest.mark.gpu
def test_real_cuda_guard_restores():
    import torch

    before = torch.cuda.current_device()
    with device_guard(0):
        assert torch.cuda.current_device() == 0
    assert torch.cuda.current_device() == before
    with pytest.raises(InvalidDeviceIndexError):
        with device_guard(torch.cuda.device_count()):
            pass
    assert torch.cuda.current_device() == before


def test_binding_switch_is_validated_and_never_restored():
    from workers.device.guard import bind_current_device

    p = SimulatedPlatform(count=2, current=0)
    bind_current_device(1, platform=p)
    assert p.current_device() == 1 and p.switches == [1]
    with pytest.raises(InvalidDeviceIndexError, match=r"`2` is absent: this process sees 2 device\(s\) \(0\.\.1\)"):
        bind_current_device(2, platform=p)
    assert p.switches == [1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA host the default platform is CUDA")
def test_without_a_platform_a_cpu_host_guards_its_one_simulated_device():
    """No CUDA: the default platform is one simulated device, current 0; the guard and the
    binding both take it when no platform is given."""
    from workers.device.guard import bind_current_device, default_platform

    p = default_platform()
    assert isinstance(p, SimulatedPlatform) and (p.device_count(), p.current_device()) == (1, 0)
    with device_guard(0) as g:
        assert isinstance(g.platform, SimulatedPlatform)
    bind_current_device(0)
    with pytest.raises(InvalidDeviceIndexError, match="`1` is absent"):
        bind_current_device(1)


def test_every_device_switch_in_the_code_goes_through_the_guard_module():
    """One guard: no module but workers/device/guard.py calls a device-switching primitive."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    switch = re.compile(r"\.set_device\(|torch\.cuda\.device\(|_exchange_device\(")
    offenders = [
        str(f.relative_to(root))
        for pkg in ("server", "workers", "kernels_local", "benchmarks", "scripts")
        for f in (root / pkg).rglob("*.py")
        if f.name != "guard.py" and switch.search(f.read_text())
    ]
    assert offenders == []
