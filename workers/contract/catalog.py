"""The architectures a simulated device may have, and the product each one stands for.

Design: a `--simulate` token names an architecture (`sm_89`, `gfx942`, `cpu`); this catalog
turns it into a capability, a representative product's name and its memory, and refuses an
architecture that does not exist (`sm_99`) rather than showing it as some product. The device
description (workers/contract/device.py) and the topology (workers/contract/topology.py) both
read it, and it reads neither. Each product also carries its published dense fp16/bf16 tensor
TFLOPS (fp32 accumulate) and memory bandwidth (`Card`): prefill is bound by the one, decode by the
other, so a simulated card can be slowed like the real one (workers/contract/slowdown.py) and a
plan can estimate a device's speed before anything ran on it. Trade-off: one product per
capability, so two cards of one architecture differ only by the memory a token gives them
(`sm_86:24GiB`), and a real card of that architecture is estimated as its catalog product.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from workers.contract.capability import Capability

ACCEPTED_TOKENS = ("sm_XY (e.g. sm_75, sm_80, sm_89, sm_90, sm_100, sm_120), gfxNNN (e.g. gfx90a, gfx942) or cpu, "
                   "each optionally with its memory (e.g. sm_86:24GiB)")

_SM_RE = re.compile(r"^sm_(\d{1,2})(\d)$")
_GFX_RE = re.compile(r"^gfx(\d{1,2})([0-9a-f])([0-9a-f])$")

# Representative product per CUDA capability: name, memory (GiB), dense fp16/bf16 tensor TFLOPS
# with fp32 accumulate, memory GB/s, as published by the vendor.
_CUDA_CATALOG: dict[tuple[int, int], tuple[str, int, float, float]] = {
    (7, 0): ("Tesla V100-SXM2-32GB", 32, 125.0, 900.0),
    (7, 5): ("Tesla T4", 16, 65.0, 320.0),
    (8, 0): ("NVIDIA A100-SXM4-80GB", 80, 312.0, 2039.0),
    (8, 6): ("NVIDIA A10", 24, 125.0, 600.0),
    (8, 7): ("NVIDIA Jetson AGX Orin", 32, 27.0, 204.8),
    (8, 9): ("NVIDIA L40S", 48, 362.0, 864.0),
    (9, 0): ("NVIDIA H100 80GB HBM3", 80, 989.0, 3350.0),
    (10, 0): ("NVIDIA B200", 180, 2250.0, 8000.0),
    (12, 0): ("NVIDIA GeForce RTX 5090", 32, 209.5, 1792.0),
}
# ROCm: one device is one GCD (an MI250X shows as two devices of 64 GiB, each with half its figures).
_ROCM_CATALOG: dict[str, tuple[str, int, float, float]] = {
    "gfx90a": ("AMD Instinct MI250X", 64, 191.5, 1638.0),
    "gfx942": ("AMD Instinct MI300X", 192, 1307.0, 5300.0),
    "gfx950": ("AMD Instinct MI355X", 288, 2516.0, 8000.0),
    "gfx1100": ("AMD Radeon RX 7900 XTX", 24, 122.8, 960.0),
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


@dataclass(frozen=True)
class Card:
    """The catalog's product for an architecture and its published speeds."""

    arch: str  # `sm_80`, `gfx942`
    name: str
    tflops: float  # dense fp16/bf16 tensor, fp32 accumulate: what bounds a prefill
    gbs: float  # memory bandwidth: what bounds a decode step (it reads every weight once)

    def describe(self) -> str:
        return f"{self.name}: {self.tflops:g} TFLOPS, {self.gbs:g} GB/s"


def card(arch: str) -> Card | None:
    """The catalog's card for an architecture token (`sm_80`, `gfx942`, or a capability label
    `8.0`); None for the CPU and for an architecture the catalog has no product for."""
    t = arch.strip().lower()
    if re.fullmatch(r"\d{1,2}\.\d", t):
        t = "sm_" + t.replace(".", "")
    t = t.split(":", 1)[0]
    try:
        dtype, cap = parse_token(t)
    except TopologySpecError:
        return None
    row = _CUDA_CATALOG.get(cap) if dtype == "cuda" else _ROCM_CATALOG.get(t) if dtype == "rocm" else None
    return None if row is None else Card(t, row[0], row[2], row[3])


def catalog_memory(arch: str) -> tuple[str, int]:
    """(product name, memory in bytes) of a simulated device's architecture token."""
    dtype, cap = parse_token(arch)
    t = arch.strip().lower()
    if dtype == "cpu":
        return "CPU (simulated)", 16 * _GIB
    if dtype == "cuda":
        assert cap is not None
        base, mem_gib, *_ = _CUDA_CATALOG.get(cap, (f"NVIDIA GPU {cap.sm}", 24))
    else:
        base, mem_gib, *_ = _ROCM_CATALOG.get(t, (f"AMD GPU {t}", 64))
    return f"{base} (simulated)", mem_gib * _GIB


def known_architectures() -> str:
    """`sm_35, ..., sm_121, gfx900, ..., gfx1201, cpu`: what `--simulate` accepts."""
    return ", ".join([*(f"sm_{a}{b}" for a, b in KNOWN_CUDA), *KNOWN_ROCM, "cpu"])
