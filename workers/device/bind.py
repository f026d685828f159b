"""Device binding and capability: the worker's first act, and the only place capability is read.

Design: `bind_device()` binds the one device this process serves and returns a frozen
`BoundDevice`; every later capability question is answered from that value, or for raw reads by
explicit index with a memo keyed by index. There is no process-wide "current device" to go stale:
a read before binding raises `DeviceNotBoundError` instead of silently reading device 0. Real
CUDA (a UUID check against what the router asked for), ROCm (`gcnArchName`), the CPU and
simulated devices (a capability from the `--simulate` token, compute on the CPU) differ only in
where the capability comes from. Trade-off: every caller must be handed the `BoundDevice`
explicitly rather than asking torch."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

from workers.contract import (
    ENV_DEVICE_INDEX,
    ENV_DEVICE_UUID,
    ENV_SIMULATE,
    Capability,
    DeviceDescribing,
    DeviceInfo,
    TopologySpecError,
    cpu_device,
    parse_token,
    simulated_device,
)
from workers.device.build import torch_build_error
from workers.device.guard import CudaPlatform, bind_current_device

logger = logging.getLogger(__name__)


class DeviceNotBoundError(RuntimeError):
    """Capability was asked for before `bind_device()`: it would have read device 0."""


class DeviceBindError(RuntimeError):
    """The process does not see exactly the one device it was given, or the UUID differs."""


@dataclass(frozen=True)
class BoundDevice(DeviceDescribing):
    """The one device this worker serves; it describes itself as the router's `DeviceInfo` does."""

    type: str  # "cuda" | "rocm" | "cpu"
    index: int  # physical index on the host (NVML / PCI order)
    uuid: str
    name: str
    capability: Capability | None
    memory_total_bytes: int
    simulated: bool
    arch: str | None = None  # the simulate token or the ROCm gcnArchName

    def __post_init__(self) -> None:
        object.__setattr__(self, "capability", Capability.parse_optional(self.capability))

    @property
    def is_real_gpu(self) -> bool:
        return self.type in ("cuda", "rocm") and not self.simulated

    @property
    def torch_device(self) -> str:
        # A bound GPU is the only visible one, so it is local index 0.
        return "cuda:0" if self.is_real_gpu else "cpu"


_bind_lock = threading.Lock()
_bound: BoundDevice | None = None
# Raw capability reads, keyed by device index: never one answer for the whole process.
_capability_by_index: dict[int, Capability] = {}


def read_capability(index: int) -> Capability:
    """Capability of CUDA device `index` (explicit index; memo keyed by index)."""
    if index is None or index < 0:
        raise ValueError(f"Device index `{index}` is invalid: an explicit index >= 0 is required")
    cap = _capability_by_index.get(index)
    if cap is None:
        import torch

        cap = Capability.parse(tuple(torch.cuda.get_device_capability(index)))
        _capability_by_index[index] = cap
    return cap


def _rocm_capability(gcn_arch_name: str) -> Capability:
    """`gfx942:sramecc+:xnack-` -> (9, 4); `gfx90a` -> (9, 0); `gfx1100` -> (11, 0)."""
    arch = gcn_arch_name.split(":", 1)[0]
    try:
        kind, cap = parse_token(arch)
    except TopologySpecError:
        kind, cap = None, None
    if kind != "rocm" or cap is None:
        raise DeviceBindError(f"Unknown ROCm arch `{gcn_arch_name}`; expected gfxNNN (e.g. gfx90a, gfx942)")
    return cap


def _bound_from_info(info: DeviceInfo, uuid: str | None = None) -> BoundDevice:
    return BoundDevice(
        type=info.type,
        index=info.index,
        uuid=uuid or info.uuid,
        name=info.name,
        capability=info.capability,
        memory_total_bytes=info.memory_total_bytes,
        simulated=info.simulated,
        arch=info.arch,
    )


def _bind_gpu(index: int, expected_uuid: str | None) -> BoundDevice:
    import torch

    # 1. exactly one device is visible: the router set CUDA_VISIBLE_DEVICES=<its UUID>
    count = torch.cuda.device_count()
    if count != 1:
        raise DeviceBindError(
            f"This worker sees {count} devices; it must see exactly 1 "
            f"(CUDA_VISIBLE_DEVICES=`{os.environ.get('CUDA_VISIBLE_DEVICES', '')}`)"
        )
    # 2. make it current for the whole life of the process (the binding itself, never undone)
    bind_current_device(0, CudaPlatform())
    props = torch.cuda.get_device_properties(0)
    # 3. it is the device the router meant
    uuid = f"GPU-{props.uuid}" if getattr(props, "uuid", None) is not None else (expected_uuid or "")
    if torch.version.hip is not None:
        # ROCr pinned the device by its KFD unique id (ROCR_VISIBLE_DEVICES); HIP reports its UUID
        # in another form, so the router's id names the device
        uuid = expected_uuid or uuid
    elif expected_uuid and expected_uuid.lower().startswith("gpu-") and uuid.lower() != expected_uuid.lower():
        raise DeviceBindError(f"Bound device UUID `{uuid}` differs from the requested `{expected_uuid}`")
    dev = _describe_gpu(index, uuid, props, torch)  # 4. capability by explicit index
    # 5. the installed torch has code this device runs (else: the reason and the build to install)
    error = torch_build_error(dev, torch)
    if error is not None:
        raise DeviceBindError(error)
    return dev


def _describe_gpu(index: int, uuid: str, props, torch) -> BoundDevice:
    if torch.version.hip is not None:
        arch = getattr(props, "gcnArchName", "") or ""
        return BoundDevice(
            type="rocm",
            index=index,
            uuid=uuid,
            name=props.name,
            capability=_rocm_capability(arch),
            memory_total_bytes=int(props.total_memory),
            simulated=False,
            arch=arch.split(":")[0],
        )
    return BoundDevice(
        type="cuda",
        index=index,
        uuid=uuid,
        name=props.name,
        capability=read_capability(0),
        memory_total_bytes=int(props.total_memory),
        simulated=False,
    )


def bind_device(simulate: str | None = None, index: int | None = None, uuid: str | None = None) -> BoundDevice:
    """Bind this process to its one device. Arguments default to the environment the router set
    (HETSERVE_SIMULATE, HETSERVE_DEVICE_INDEX, HETSERVE_DEVICE_UUID, CUDA_VISIBLE_DEVICES).
    With no simulation and no CUDA, the process binds the CPU."""
    global _bound
    simulate = simulate if simulate is not None else os.environ.get(ENV_SIMULATE) or None
    if index is None:
        index = int(os.environ.get(ENV_DEVICE_INDEX, "0") or 0)
    uuid = uuid if uuid is not None else os.environ.get(ENV_DEVICE_UUID) or None
    if uuid is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        uuid = visible if visible.lower().startswith(("gpu-", "mig-")) else None
    with _bind_lock:
        if simulate:
            dev = _bound_from_info(simulated_device(simulate, index), uuid)
        else:
            import torch

            dev = _bind_gpu(index, uuid) if torch.cuda.is_available() else _bound_from_info(cpu_device())
        if _bound is not None and _bound != dev:
            raise DeviceBindError(f"This process is already bound to `{_bound.uuid}`; refusing `{dev.uuid}`")
        _bound = dev
    logger.info("bound %s device %s (%s), capability %s", dev.type, dev.index, dev.name, dev.capability_str)
    return dev


def bound_device() -> BoundDevice:
    """The device this process serves; `DeviceNotBoundError` before `bind_device()`."""
    dev = _bound
    if dev is None:
        raise DeviceNotBoundError(
            "Capability was read before the worker bound its device: call `bind_device()` first"
        )
    return dev


def capability() -> Capability | None:
    """Capability of the bound device (None for a CPU); `DeviceNotBoundError` before binding."""
    return bound_device().capability


