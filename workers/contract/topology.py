"""Device descriptions that need no torch: the simulated topology and `--devices` selection.

Both the router (which must never initialize CUDA) and the worker read this module, so it
imports nothing heavy. A simulated device carries only what a real one would report
(capability, name, memory, UUID); every decision made from it runs the real code.

Spec tokens: `sm_XY` / `sm_XXY` (CUDA capability X.Y, e.g. `sm_89`, `sm_100`), `gfxNNN`
(ROCm arch, e.g. `gfx90a`, `gfx942`) and `cpu`, each optionally followed by `:SIZE`, the
device's memory (`sm_86:24GiB`; workers/contract/sizes.py): without it, the catalog's
product's. Placement (server/fleet/placement.py) reads that memory, so a test can give
simulated devices budgets that small models fill. A device's `simulate_token` carries the
size only when it differs from the catalog's, so the token a worker receives is the one the
user wrote, or as short.
"""

from __future__ import annotations

import os
import re

from workers.contract.capability import Capability
from workers.contract.device import DeviceInfo
from workers.contract.sizes import SizeError, parse_size

ACCEPTED_TOKENS = ("sm_XY (e.g. sm_75, sm_80, sm_89, sm_90, sm_100, sm_120), gfxNNN (e.g. gfx90a, gfx942) or cpu, "
                   "each optionally with its memory (e.g. sm_86:24GiB)")
ACCEPTED_DEVICES = "all, comma-separated indices (e.g. 0,2) or GPU UUIDs (e.g. GPU-...)"

_SM_RE = re.compile(r"^sm_(\d{1,2})(\d)$")
_GFX_RE = re.compile(r"^gfx(\d{1,2})([0-9a-f])([0-9a-f])$")

# Representative product per CUDA capability, for names and memory of simulated devices.
_CUDA_CATALOG: dict[tuple[int, int], tuple[str, int]] = {
    (7, 0): ("Tesla V100-SXM2-32GB", 32),
    (7, 5): ("Tesla T4", 16),
    (8, 0): ("NVIDIA A100-SXM4-80GB", 80),
    (8, 6): ("NVIDIA A10", 24),
    (8, 7): ("NVIDIA Jetson AGX Orin", 32),
    (8, 9): ("NVIDIA L40S", 48),
    (9, 0): ("NVIDIA H100 80GB HBM3", 80),
    (10, 0): ("NVIDIA B200", 180),
    (12, 0): ("NVIDIA GeForce RTX 5090", 32),
}
_ROCM_CATALOG: dict[str, tuple[str, int]] = {
    "gfx90a": ("AMD Instinct MI250X", 64),
    "gfx942": ("AMD Instinct MI300X", 192),
    "gfx950": ("AMD Instinct MI355X", 288),
    "gfx1100": ("AMD Radeon RX 7900 XTX", 24),
}
_GIB = 1024**3
# Architectures a simulated device may have: the CUDA capabilities and ROCm targets that exist, so
# that a typo (`sm_99`) is refused rather than shown as some product; real devices are read as they
# report, whatever their architecture.
KNOWN_CUDA = ((3, 5), (3, 7), (5, 0), (5, 2), (5, 3), (6, 0), (6, 1), (6, 2), (7, 0), (7, 2), (7, 5), (8, 0),
              (8, 6), (8, 7), (8, 9), (9, 0), (10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1))
KNOWN_ROCM = ("gfx900", "gfx906", "gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950", "gfx1030", "gfx1100",
              "gfx1101", "gfx1102", "gfx1150", "gfx1151", "gfx1200", "gfx1201")


class TopologySpecError(ValueError):
    """A `--simulate` or `--devices` value that cannot be understood."""

    exit_code = 2


def parse_token(token: str) -> tuple[str, Capability | None]:
    """`sm_89` -> ("cuda", (8, 9)); `gfx942` -> ("rocm", (9, 4)); `cpu` -> ("cpu", None)."""
    t = token.strip().lower()
    if t == "cpu":
        return "cpu", None
    m = _SM_RE.match(t)
    if m:
        major, minor = int(m.group(1)), int(m.group(2))
        if 3 <= major <= 15:
            return "cuda", Capability(major, minor)
    m = _GFX_RE.match(t)
    if m:
        return "rocm", Capability(int(m.group(1)), int(m.group(2), 16))
    raise TopologySpecError(f"Unknown simulated device `{token}`. Accepted: {ACCEPTED_TOKENS}")


def split_memory(token: str) -> tuple[str, int | None]:
    """`sm_86:24GiB` -> ("sm_86", 25769803776); `sm_86` -> ("sm_86", None). `TopologySpecError`
    naming the token when the size cannot be read."""
    arch, sep, size = token.strip().partition(":")
    if not sep:
        return arch, None
    try:
        return arch, parse_size(size)
    except SizeError as e:
        raise TopologySpecError(f"Simulated device `{token.strip()}` (ARCH:SIZE): {e}") from e


def catalog_memory(arch: str) -> tuple[str, int]:
    """(product name, memory in bytes) of a simulated device's architecture token."""
    dtype, cap = parse_token(arch)
    t = arch.strip().lower()
    if dtype == "cpu":
        return "CPU (simulated)", 16 * _GIB
    if dtype == "cuda":
        assert cap is not None
        base, mem_gib = _CUDA_CATALOG.get(cap, (f"NVIDIA GPU {cap.sm}", 24))
    else:
        base, mem_gib = _ROCM_CATALOG.get(t, (f"AMD GPU {t}", 64))
    return f"{base} (simulated)", mem_gib * _GIB


def known_architectures() -> str:
    """`sm_35, ..., sm_121, gfx900, ..., gfx1201, cpu`: what `--simulate` accepts."""
    return ", ".join([*(f"sm_{a}{b}" for a, b in KNOWN_CUDA), *KNOWN_ROCM, "cpu"])


def simulated_device(token: str, index: int) -> DeviceInfo:
    """The simulated device for one spec token (`sm_89`, `sm_86:24GiB`) at position `index`;
    an architecture that does not exist (`sm_99`) is a `TopologySpecError` listing the known ones."""
    arch, memory = split_memory(token)
    dtype, cap = parse_token(arch)
    if (dtype == "cuda" and tuple(cap) not in KNOWN_CUDA) or (dtype == "rocm" and arch.strip().lower() not in KNOWN_ROCM):
        where = f" in `{token.strip()}`" if token.strip() != arch.strip() else ""
        raise TopologySpecError(f"Unknown simulated architecture `{arch.strip()}`{where}. Known: {known_architectures()}")
    name, default_memory = catalog_memory(arch)
    return DeviceInfo(
        index=index,
        uuid=f"GPU-5e000000-0000-4000-8000-{index:012d}",
        name=name,
        type=dtype,
        capability=cap,
        memory_total_bytes=default_memory if memory is None else memory,
        simulated=True,
        pci_bus_id=f"00000000:{0x10 + index:02X}:00.0",
        arch=arch.strip().lower(),
    )


def cpu_device() -> DeviceInfo:
    """The host CPU as a device: what a host without GPUs (and without `--simulate`) serves on."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    return DeviceInfo(
        index=0, uuid="cpu", name="CPU", type="cpu", capability=None, memory_total_bytes=mem, simulated=False, arch="cpu"
    )


def parse_simulate(spec: str) -> list[DeviceInfo]:
    """`sm_80,sm_89,sm_90` -> three simulated devices, indices 0..2 in spec order."""
    tokens = [t for t in (spec or "").split(",")]
    if not spec or any(not t.strip() for t in tokens):
        raise TopologySpecError(f"Empty device in `--simulate {spec}`. Accepted: {ACCEPTED_TOKENS}, comma-separated")
    return [simulated_device(t, i) for i, t in enumerate(tokens)]


def select_devices(inventory: list[DeviceInfo], spec: str | None) -> list[DeviceInfo]:
    """Apply `--devices all|0,2|UUID,...` to an inventory, keeping the order given."""
    if spec is None or spec.strip().lower() in ("", "all"):
        return list(inventory)
    by_index = {d.index: d for d in inventory}
    by_uuid = {d.uuid.lower(): d for d in inventory}
    chosen: list[DeviceInfo] = []
    for raw in spec.split(","):
        tok = raw.strip()
        if tok.isdigit():
            dev = by_index.get(int(tok))
            if dev is None:
                have = ", ".join(str(i) for i in sorted(by_index)) or "none"
                raise TopologySpecError(
                    f"Device index `{tok}` is out of range. This host has indices: {have}. Accepted: {ACCEPTED_DEVICES}"
                )
        elif tok.lower().startswith(("gpu-", "mig-")):
            dev = by_uuid.get(tok.lower())
            if dev is None:
                raise TopologySpecError(
                    f"Unknown GPU UUID `{tok}`. Known: {', '.join(d.uuid for d in inventory) or 'none'}"
                )
        else:
            raise TopologySpecError(f"Invalid device `{tok}` in `--devices {spec}`. Accepted: {ACCEPTED_DEVICES}")
        if dev in chosen:
            raise TopologySpecError(f"Device `{tok}` is listed twice in `--devices {spec}`")
        chosen.append(dev)
    return chosen
