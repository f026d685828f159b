"""The router's view of the host's GPUs: NVML or the simulated topology, never CUDA.

Design: the router must hold no CUDA context and no capability of its own (a capability read
in the parent would be device 0's answer), so it lists devices through NVML (nvidia-ml-py),
which reports index, UUID, name, capability, memory and PCI bus id without creating a
context. Devices are returned in PCI bus order, the order `CUDA_DEVICE_ORDER=PCI_BUS_ID`
gives the workers. AMD GPUs come from the amdgpu driver's KFD topology in sysfs, also without
a context, after the NVIDIA ones. No driver of either kind (a CPU host) means an empty inventory.
"""

from __future__ import annotations

import logging

from workers.contract import DeviceInfo, parse_simulate

logger = logging.getLogger(__name__)


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def nvml_inventory() -> list[DeviceInfo]:
    """Every GPU NVML reports, in PCI bus order; [] when NVML or the driver is absent."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        logger.debug("NVML unavailable: %s", e)
        return []
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            devices.append(
                DeviceInfo(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    name=_text(pynvml.nvmlDeviceGetName(h)),
                    type="cuda",
                    capability=(int(major), int(minor)),
                    memory_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                    simulated=False,
                    pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(h).busId),
                )
            )
    finally:
        pynvml.nvmlShutdown()
    devices.sort(key=lambda d: (d.pci_bus_id or "", d.index))
    return devices


def inventory(simulate: str | None = None, kfd_nodes=None) -> list[DeviceInfo]:
    """The simulated topology when `simulate` is given, else the host's GPUs: NVIDIA's through
    NVML, then AMD's through the driver's KFD topology (`server.commands.inventory_amd`)."""
    if simulate:
        return parse_simulate(simulate)
    from server.commands.inventory_amd import KFD_NODES, kfd_inventory

    devices = nvml_inventory()
    return devices + kfd_inventory(kfd_nodes or KFD_NODES, first_index=len(devices))
