"""The host's AMD GPUs from the kernel driver's topology in sysfs: no HIP context, no ROCm libraries.

Design: as NVML does for NVIDIA, the amdgpu driver's KFD topology describes every GPU without
creating a device context: `/sys/class/kfd/kfd/topology/nodes/<n>/properties` holds one
`key value` pair per line (`gfx_target_version 90402`, `simd_count 304`, `unique_id ...`,
`location_id`, `domain`, `device_id`), and `mem_banks/<b>/properties` the VRAM banks
(`heap_type 1` or `2`, `size_in_bytes`). Nodes without SIMDs are CPUs and are skipped.
`gfx_target_version` is `major * 10000 + minor * 100 + stepping` in decimal, the
architecture `gfx<major><minor><stepping as one hex digit>` (90402 -> gfx942, 90010 ->
gfx90a, 110000 -> gfx1100). GPUs keep the node order, which is the order HIP and ROCr
enumerate them; the worker is pinned by `ROCR_VISIBLE_DEVICES=<uuid>` (ROCr accepts
`GPU-<unique id in hex>`), so no index needs to agree across vendors on a host that also has
NVIDIA cards. Trade-off: the marketing name comes from a small table of PCI device ids (the
driver's sysfs has no name); an unknown id is named by its architecture.
"""

from __future__ import annotations

import logging
from pathlib import Path

from workers.contract import DeviceInfo, TopologySpecError, parse_token

logger = logging.getLogger(__name__)

KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")
_VRAM_HEAPS = ("1", "2")  # HSA_HEAPTYPE_FRAME_BUFFER_PUBLIC / _PRIVATE
# PCI device id -> name (the Instinct and Radeon parts hetserve is tested against)
_NAMES = {
    0x740F: "AMD Instinct MI210", 0x740C: "AMD Instinct MI250X", 0x74A1: "AMD Instinct MI300X",
    0x74A5: "AMD Instinct MI325X", 0x75A0: "AMD Instinct MI350X", 0x75A3: "AMD Instinct MI355X",
    0x744C: "AMD Radeon RX 7900 XTX", 0x7448: "AMD Radeon PRO W7900", 0x7550: "AMD Radeon RX 9070 XT",
}


def _properties(path: Path) -> dict[str, str]:
    """`key value` lines of a properties file; {} when it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            out[key] = value.strip()
    return out


def gfx_arch(target_version: int) -> str:
    """KFD's `gfx_target_version` -> the architecture name (`90402` -> `gfx942`)."""
    major, minor, stepping = target_version // 10000, (target_version // 100) % 100, target_version % 100
    if minor > 15 or stepping > 15:
        raise ValueError(f"`gfx_target_version {target_version}` is not major*10000 + minor*100 + stepping")
    return f"gfx{major}{minor:x}{stepping:x}"


def _vram(node: Path) -> int:
    total = 0
    for bank in sorted((node / "mem_banks").glob("*")):
        props = _properties(bank / "properties")
        if props.get("heap_type") in _VRAM_HEAPS:
            total += int(props.get("size_in_bytes", "0") or 0)
    return total


def kfd_inventory(nodes: Path = KFD_NODES, first_index: int = 0) -> list[DeviceInfo]:
    """Every AMD GPU the KFD topology lists, in node order, indexed from `first_index` (after
    the host's NVIDIA devices); [] without the driver."""
    if not nodes.is_dir():
        return []
    found = []
    for node in sorted(nodes.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 1 << 30):
        props = _properties(node / "properties")
        if int(props.get("simd_count", "0") or 0) == 0:
            continue  # a CPU node
        try:
            arch = gfx_arch(int(props.get("gfx_target_version", "0")))
            kind, cap = parse_token(arch)
        except (ValueError, TopologySpecError) as e:
            logger.warning("KFD node %s skipped: %s", node.name, e)
            continue
        unique = int(props.get("unique_id", "0") or 0)
        device_id = int(props.get("device_id", "0") or 0)
        location, domain = int(props.get("location_id", "0") or 0), int(props.get("domain", "0") or 0)
        bus = f"{domain:08X}:{location >> 8:02X}:{(location >> 3) & 0x1F:02X}.{location & 0x7}"
        found.append(DeviceInfo(
            index=first_index + len(found),
            uuid=f"GPU-{unique:016x}" if unique else f"GPU-kfd-node-{node.name}",
            name=_NAMES.get(device_id, f"AMD GPU {arch}"),
            type=kind, capability=cap, memory_total_bytes=_vram(node), simulated=False, pci_bus_id=bus, arch=arch,
        ))
    return found
