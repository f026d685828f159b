"""Device descriptions that need no torch: the simulated topology and `--devices` selection.

Design: both the router (which must never initialize CUDA) and the worker read this module, so
it imports nothing heavy, and a simulated device carries only what a real one would report
(capability, name, memory, UUID), so every decision made from it runs the real code. Spec
tokens are `sm_XY` / `sm_XXY`, `gfxNNN` and `cpu`, each optionally with `:SIZE`, the device's
memory (`sm_86:24GiB`), else the catalog product's (workers/contract/catalog.py); placement reads
that memory, so a test can give simulated devices budgets small models fill. Trade-off: a device's
`simulate_token` carries the size only when it differs from the catalog's, so the token a worker
receives is the one the user wrote, or shorter."""

from __future__ import annotations

import os

from workers.contract.catalog import (
    ACCEPTED_TOKENS,
    KNOWN_CUDA,
    KNOWN_ROCM,
    TopologySpecError,
    catalog_memory,
    known_architectures,
    parse_token,
)
from workers.contract.device import DeviceInfo
from workers.contract.sizes import SizeError, parse_size

ACCEPTED_DEVICES = "all, comma-separated indices (e.g. 0,2) or GPU UUIDs (e.g. GPU-...)"


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


def simulated_device(token: str, index: int) -> DeviceInfo:
    """The simulated device for one spec token (`sm_89`, `sm_86:24GiB`) at position `index`;
    an architecture that does not exist (`sm_99`) is a `TopologySpecError` listing the known ones."""
    arch, memory = split_memory(token)
    dtype, cap = parse_token(arch)
    if ((dtype == "cuda" and tuple(cap) not in KNOWN_CUDA)
            or (dtype == "rocm" and arch.strip().lower() not in KNOWN_ROCM)):
        where = f" in `{token.strip()}`" if token.strip() != arch.strip() else ""
        raise TopologySpecError(f"Unknown simulated architecture `{arch.strip()}`{where}. "
                                f"Known: {known_architectures()}")
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
        index=0, uuid="cpu", name="CPU", type="cpu", capability=None, memory_total_bytes=mem, simulated=False,
        arch="cpu",
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
