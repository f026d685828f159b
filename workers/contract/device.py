"""The device description that the router and the worker exchange.

The router knows a device from NVML or the simulated topology (`DeviceInfo`); the worker
knows the device it bound (`workers.device.BoundDevice`). Both describe themselves the same
way, through `DeviceDescribing`: the seven fields `/workers`, `/capability` and `hetserve
plan` show (`DEVICE_FIELDS`), with the capability as its label ("9.0"). One description
means a field added or renamed on one side cannot silently go missing on the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.contract.capability import Capability, capability_label
from workers.contract.catalog import catalog_memory
from workers.contract.sizes import format_size

DEVICE_FIELDS = ("type", "index", "uuid", "name", "capability", "simulated", "memory_total_bytes")


class DeviceDescribing:
    """Mixin for frozen device dataclasses with the `DEVICE_FIELDS` attributes."""

    capability: Capability | None
    type: str

    @property
    def capability_str(self) -> str | None:
        """`"9.0"`, or None for a device without a capability (a CPU)."""
        return None if self.capability is None else Capability.parse(self.capability).label

    @property
    def arch_name(self) -> str:
        """`sm_89`, `gfx942` or `cpu`: the architecture code for this device is compiled for
        (its Triton cache directory and preflight target)."""
        if self.type == "cpu" or self.capability is None:
            return "cpu"
        if self.type == "rocm":
            arch = (getattr(self, "arch", None) or "").split(":")[0].strip().lower()
            return arch or f"rocm-{Capability.parse(self.capability).label}"
        return Capability.parse(self.capability).sm

    @property
    def computes_on_cpu(self) -> bool:
        """Whether this device's worker computes on the host's CPU: a CPU, or a simulated device."""
        return bool(getattr(self, "simulated", False)) or self.type == "cpu"

    @property
    def capability_label(self) -> str:
        """`"9.0"`, or `"cpu"`: the `capability` label of metrics and headers."""
        return capability_label(self.capability)

    def to_dict(self) -> dict:
        """The `/workers` `device` object: exactly `DEVICE_FIELDS`."""
        out = {name: getattr(self, name) for name in DEVICE_FIELDS}
        out["capability"] = self.capability_str
        return out


@dataclass(frozen=True)
class DeviceInfo(DeviceDescribing):
    """One device as the router sees it (from NVML or the simulated topology)."""

    index: int
    uuid: str
    name: str
    type: str  # "cuda" | "rocm" | "cpu"
    capability: Capability | None
    memory_total_bytes: int
    simulated: bool
    pci_bus_id: str | None = None
    arch: str | None = None  # the spec token (`sm_89`, `gfx942`, `cpu`) or the ROCm arch

    def __post_init__(self) -> None:
        object.__setattr__(self, "capability", Capability.parse_optional(self.capability))

    @property
    def simulate_token(self) -> str | None:
        """The `--simulate` token that recreates this device (`sm_89`, `gfx942`, `cpu`, with
        `:SIZE` when its memory is not the catalog's: `sm_86:24GiB`); None for a real device."""
        if not self.simulated:
            return None
        arch = self.arch or ("cpu" if self.capability is None else self.capability.sm)
        if catalog_memory(arch)[1] == self.memory_total_bytes:
            return arch
        return f"{arch}:{format_size(self.memory_total_bytes)}"
