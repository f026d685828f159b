"""Device binding (bind first) and capability (no process-wide cache). Only the capability source
is faked: torch.cuda's answers are patched, the binding code is the real one."""

from __future__ import annotations

import time
import uuid as uuidlib
from types import SimpleNamespace

import pytest
import torch

from tests.process_state import unbind_device
from workers.device.bind import (
    BoundDevice,
    DeviceBindError,
    DeviceNotBoundError,
    bind_device,
    bound_device,
    capability,
    read_capability,
)
from workers.kernelize.crosscheck import check_kernels_capability

H100_UUID = uuidlib.UUID("6f1c1d2e-0000-4000-8000-00000000a100")


@pytest.fixture(autouse=True)
def _unbound(monkeypatch):
    for k in ("HETSERVE_SIMULATE", "HETSERVE_DEVICE_INDEX", "HETSERVE_DEVICE_UUID", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(k, raising=False)
    unbind_device()
    yield
    unbind_device()


@pytest.fixture
def fake_cuda(monkeypatch):
    """A host whose CUDA devices report the capabilities in `caps` (by index)."""
    state = SimpleNamespace(caps={0: (9, 0)}, visible=1, current=0, reads=[])

    def get_device_capability(device=None):
        idx = state.current if device is None else int(device)
        state.reads.append(device)
        return state.caps[idx]

    def set_device(i):
        state.current = int(i)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state.visible)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state.current)
    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    state.props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid=H100_UUID, total_memory=80 << 30)

    def get_device_properties(i):
        assert i == 0, f"properties of device {i!r}: a bound worker sees one device, index 0"
        return state.props

    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    monkeypatch.setattr(torch.version, "hip", None)
    return state


def test_capability_before_binding_raises():
    """Guards `if dev is None: raise DeviceNotBoundError` in `bound_device`: without it a
    capability read before binding would answer for device 0."""
    with pytest.raises(DeviceNotBoundError, match="^Capability was read before the worker bound its device"):
        capability()
    with pytest.raises(DeviceNotBoundError):
        bound_device()


def test_bind_simulated_from_environment(monkeypatch):
    monkeypatch.setenv("HETSERVE_SIMULATE", "sm_89")
    monkeypatch.setenv("HETSERVE_DEVICE_INDEX", "1")
    dev = bind_device()
    assert dev.simulated and dev.type == "cuda" and dev.capability == (8, 9) and dev.index == 1
    assert capability() == (8, 9)
    assert dev.torch_device == "cpu"
    assert dev.to_dict()["capability"] == "8.9" and dev.to_dict()["simulated"] is True
    with pytest.raises(AttributeError):
        dev.capability = (9, 0)  # frozen


def test_simulated_binding_describes_the_simulated_device():
    from workers.contract import simulated_device

    info = simulated_device("gfx942", 3)
    dev = bind_device(simulate="gfx942", index=3)
    assert dev == BoundDevice(type="rocm", index=3, uuid=info.uuid, name=info.name, capability=(9, 4),
                              memory_total_bytes=info.memory_total_bytes, simulated=True, arch="gfx942")  # fmt: skip


def test_binding_takes_the_routers_environment(monkeypatch):
    """The router passes the device as HETSERVE_SIMULATE / _DEVICE_INDEX / _DEVICE_UUID; an empty
    index means 0."""
    monkeypatch.setenv("HETSERVE_SIMULATE", "sm_80")
    monkeypatch.setenv("HETSERVE_DEVICE_INDEX", "")
    monkeypatch.setenv("HETSERVE_DEVICE_UUID", "GPU-from-the-router")
    dev = bind_device()
    assert (dev.index, dev.uuid, dev.capability) == (0, "GPU-from-the-router", (8, 0))


def test_bind_cpu_without_cuda_or_simulation():
    dev = bind_device()
    assert dev.type == "cpu" and dev.capability is None and not dev.simulated
    assert dev.memory_total_bytes > 0


def test_binding_twice_to_another_device_is_refused():
    bind_device(simulate="sm_80", index=0)
    bind_device(simulate="sm_80", index=0)  # the same device again is fine
    with pytest.raises(DeviceBindError, match="already bound"):
        bind_device(simulate="sm_90", index=2)


def test_bind_real_cuda_checks_uuid_and_reads_capability_by_index(fake_cuda, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"GPU-{H100_UUID}")
    dev = bind_device(index=3)
    assert dev == BoundDevice(
        type="cuda", index=3, uuid=f"GPU-{H100_UUID}", name="NVIDIA H100 80GB HBM3",
        capability=(9, 0), memory_total_bytes=80 << 30, simulated=False,
    )
    assert None not in fake_cuda.reads  # never the implicit "current device"
    assert dev.torch_device == "cuda:0"


def test_bind_refuses_more_than_one_visible_device(fake_cuda, monkeypatch):
    fake_cuda.visible = 2
    with pytest.raises(DeviceBindError, match=r"sees 2 devices; it must see exactly 1 \(CUDA_VISIBLE_DEVICES=``\)"):
        bind_device()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(DeviceBindError, match=r"\(CUDA_VISIBLE_DEVICES=`0,1`\)"):
        bind_device()


def test_bind_refuses_a_different_uuid(fake_cuda):
    with pytest.raises(DeviceBindError, match="differs"):
        bind_device(uuid="GPU-00000000-1111-2222-3333-444444444444")


@pytest.mark.parametrize("visible", ["GPU-00000000-1111-2222-3333-444444444444",
                                     "gpu-00000000-1111-2222-3333-444444444444"])
def test_the_uuid_in_cuda_visible_devices_is_the_one_checked(fake_cuda, monkeypatch, visible):
    """With no explicit UUID, the one the router put in CUDA_VISIBLE_DEVICES (any case) is checked."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(DeviceBindError, match=f"differs from the requested `{visible}`"):
        bind_device()


def test_device_indices_in_cuda_visible_devices_are_no_uuid(fake_cuda, monkeypatch):
    """`CUDA_VISIBLE_DEVICES=0` names a device by position, not by UUID: nothing to check or keep."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    fake_cuda.props.uuid = None
    assert bind_device().uuid == ""
    unbind_device()
    assert bind_device(simulate="sm_80").uuid.startswith("GPU-5e000000-")


def test_a_mig_instance_keeps_its_id_when_the_driver_reports_no_uuid(fake_cuda, monkeypatch):
    fake_cuda.props.uuid = None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5e1f0000-0000-4000-8000-000000000001")
    assert bind_device().uuid == "MIG-5e1f0000-0000-4000-8000-000000000001"


def test_rocm_capability_from_gcn_arch_name(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    fake_cuda.props = SimpleNamespace(name="AMD Instinct MI300X", uuid=None, gcnArchName="gfx942:sramecc+:xnack-",
                                      total_memory=192 << 30)  # fmt: skip
    dev = bind_device(index=2)
    assert dev == BoundDevice(type="rocm", index=2, uuid="", name="AMD Instinct MI300X", capability=(9, 4),
                              memory_total_bytes=192 << 30, simulated=False, arch="gfx942")  # fmt: skip
    assert dev.is_real_gpu and dev.torch_device == "cuda:0"


def test_rocm_without_a_uuid_keeps_the_one_the_router_gave(fake_cuda, monkeypatch):
    """A ROCm device whose properties carry no `uuid` attribute keeps the router's UUID."""
    monkeypatch.setattr(torch.version, "hip", "6.2")
    fake_cuda.props = SimpleNamespace(name="AMD Instinct MI250X", gcnArchName="gfx90a", total_memory=64 << 30)
    assert bind_device(uuid="GPU-abc").uuid == "GPU-abc"


@pytest.mark.parametrize("arch", ["sm_90", "gfx", ""], ids=repr)
def test_unknown_rocm_arch_is_named(fake_cuda, monkeypatch, arch):
    """Guards `if kind != "rocm" or cap is None` in `_rocm_capability`: a token that parses as
    another kind of device (`sm_90`) is no ROCm arch either."""
    monkeypatch.setattr(torch.version, "hip", "6.2")
    fake_cuda.props = SimpleNamespace(name="AMD GPU", uuid=None, gcnArchName=arch, total_memory=1 << 30)
    with pytest.raises(DeviceBindError, match=f"^Unknown ROCm arch `{arch}`; expected gfxNNN"):
        bind_device()


def test_rocm_properties_without_an_arch_are_refused(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    fake_cuda.props = SimpleNamespace(name="AMD GPU", uuid=None, total_memory=1 << 30)
    with pytest.raises(DeviceBindError, match="^Unknown ROCm arch ``"):
        bind_device()


def test_capability_memo_is_keyed_by_device_index(fake_cuda):
    """Guards `_capability_by_index[index] = cap` (a memo keyed by index): a process-wide memo
    of the first answer would give device 1 device 0's capability."""
    fake_cuda.caps = {0: (8, 0), 1: (9, 0)}
    fake_cuda.visible = 2
    assert read_capability(0) == (8, 0)
    assert read_capability(1) == (9, 0)
    assert read_capability(0) == (8, 0)
    with pytest.raises(ValueError, match="`-1`"):
        read_capability(-1)


def test_capability_memo_reads_each_device_once(fake_cuda):
    """The memo is real: a second read of one index does not ask the driver again."""
    fake_cuda.caps = {0: (8, 0), 1: (9, 0)}
    fake_cuda.visible = 2
    for _ in range(3):
        read_capability(0), read_capability(1)
    assert fake_cuda.reads == [0, 1]


def test_kernels_library_capability_cache_goes_stale(fake_cuda):
    """The failure a per-device capability removes: `kernels`' `_find_capability` is an lru_cache over the
    current device, so after the device changes it keeps the first answer."""
    from kernels.layer.repos import _find_capability

    fake_cuda.caps = {0: (8, 0), 1: (9, 0)}
    _find_capability.cache_clear()
    try:
        assert _find_capability() == 80
        fake_cuda.current = 1
        assert _find_capability() == 80  # stale: device 1 is 9.0
    finally:
        _find_capability.cache_clear()


def test_startup_cross_check_refuses_a_stale_kernels_capability(fake_cuda):
    """Guards `if theirs != ours: return False` in `check_kernels_capability`."""
    from kernels.layer.repos import _find_capability

    fake_cuda.caps = {0: (8, 0)}
    _find_capability.cache_clear()
    try:
        _find_capability()  # kernels memoizes 8.0 ...
        fake_cuda.caps = {0: (9, 0)}  # ... then the process binds a 9.0 device
        dev = bind_device()
        ok, reason = check_kernels_capability(dev)
        assert not ok and "80" in reason and "90" in reason
        _find_capability.cache_clear()
        ok, reason = check_kernels_capability(dev)
        assert ok, reason
    finally:
        _find_capability.cache_clear()


def test_simulated_devices_need_no_kernels_cross_check():
    ok, reason = check_kernels_capability(bind_device(simulate="sm_90"))
    assert (ok, reason) == (True, "no real CUDA device (simulated cuda): nothing to cross-check")
    cpu = BoundDevice(type="cpu", index=0, uuid="cpu", name="CPU", capability=None, memory_total_bytes=1,
                      simulated=False)  # fmt: skip
    assert check_kernels_capability(cpu) == (True, "no real CUDA device (cpu): nothing to cross-check")


def test_capability_lookup_after_binding_is_cheap():
    """Not a timing assertion: prints the measured cost (the README quotes it)."""
    bind_device(simulate="sm_90")
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        capability()
    per_call_ns = (time.perf_counter() - t0) / n * 1e9
    print(f"capability() after binding: {per_call_ns:.0f} ns per call")
    assert capability() == (9, 0)


@pytest.mark.gpu
def test_real_gpu_binding():
    dev = bind_device()
    assert dev.type in ("cuda", "rocm") and dev.capability == tuple(torch.cuda.get_device_capability(0))
    ok, reason = check_kernels_capability(dev)
    assert ok, reason
