"""What each GPU architecture we claim can hold per block, and which tensor-core instruction
its compiled kernels must use: the table the preflight checks every compiled kernel against.

Design: one row per architecture name (`sm_89`, `gfx942`, as `--simulate` spells them), each
figure with its source beside it (the sources, and the table: docs/preflight.md). A compiled
kernel fits when its shared memory and its registers per thread and per block are within the
row; a kernel using tensor cores must show the instruction the row expects for its operand type
(fp8 or fp16; Triton emits no mma below sm_80, where its fp16 dots lower to FMAs). An
architecture without a row takes the closest older row of its family (sm_121 reads sm_120's,
CUDA's binary compatibility within a major), never a guess across families. Trade-off: a
published table, not the hardware: on a real GPU the device's own figures replace the row, and
`scripts/gpu_check.sh` compares the two."""

from __future__ import annotations

import re
from dataclasses import dataclass

KIB = 1024


@dataclass(frozen=True)
class ArchLimits:
    """One architecture's per-block limits and expected tensor-core instructions."""

    arch: str  # "sm_89" | "gfx942"
    shared_bytes: int  # shared memory (LDS) per block
    registers_per_thread: int
    registers_per_block: int
    warp_size: int
    fp8: str | None  # native e4m3 flavour of its matrix cores ("e4m3fn" | "e4m3fnuz"), None without
    fp8_instruction: str | None  # regex a native fp8 dot must match; None: no fp8 tensor cores
    f16_instruction: str | None  # regex an fp16 dot must match; None: Triton uses no tensor cores
    source: str

    def expected_instruction(self, dot: str) -> str | None:
        """The instruction pattern a dot on `dot` operands ("fp8" | "f16") must compile to."""
        return self.fp8_instruction if dot == "fp8" else self.f16_instruction

    def to_dict(self) -> dict:
        return {
            "arch": self.arch,
            "shared_bytes": self.shared_bytes,
            "registers_per_thread": self.registers_per_thread,
            "registers_per_block": self.registers_per_block,
            "warp_size": self.warp_size,
            "fp8": self.fp8,
            "source": self.source,
        }


_CUDA_GUIDE = "CUDA C++ Programming Guide, Technical Specifications per Compute Capability"
_ROCM_SPECS = "ROCm docs, AMD GPU specifications (LDS, wavefront, VGPR file per CU)"
_MMA_F16 = r"^mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(f16|bf16)"
_MMA_E4M3 = r"^mma\.sync\.aligned\.m16n8k32\.row\.col\.f32\.e4m3\.e4m3"
_WGMMA_E4M3, _WGMMA_F16 = r"^wgmma\.mma_async\.\S*\.e4m3\.e4m3", r"^wgmma\.mma_async\.\S*\.(f16|bf16)"
_TCGEN05_F8, _TCGEN05_F16 = r"^tcgen05\.mma\.\S*kind::f8f6f4", r"^tcgen05\.mma\.\S*kind::f16"
_MFMA_F16 = r"^v_mfma_f32_\w+f16"


def _cuda(arch, shared_kib, fp8_instruction, f16_instruction, note) -> ArchLimits:
    return ArchLimits(arch, shared_kib * KIB, 255, 65536, 32, "e4m3fn" if fp8_instruction else None,
                      fp8_instruction, f16_instruction, f"{_CUDA_GUIDE}: {note}")  # fmt: skip


def _rocm(arch, lds_kib, fp8, fp8_instruction, note) -> ArchLimits:
    # 512 VGPRs (architected + accumulation) per lane; a workgroup shares its CU's 4 SIMDs.
    return ArchLimits(arch, lds_kib * KIB, 512, 4 * 64 * 512, 64, fp8, fp8_instruction, _MFMA_F16,
                      f"{_ROCM_SPECS}: {note}")  # fmt: skip


# fmt: off
ARCH_LIMITS: dict[str, ArchLimits] = {a.arch: a for a in (
    _cuda("sm_70", 96, None, None, "V100, 96 KB shared memory per block"),
    _cuda("sm_75", 64, None, None, "T4, 64 KB shared memory per block"),
    _cuda("sm_80", 163, None, _MMA_F16, "A100, 163 KB shared memory per block"),
    _cuda("sm_86", 99, None, _MMA_F16, "A10/RTX 30, 99 KB shared memory per block"),
    _cuda("sm_87", 163, None, _MMA_F16, "Jetson Orin, 163 KB shared memory per block"),
    _cuda("sm_89", 99, _MMA_E4M3, _MMA_F16, "L40S/RTX 40, 99 KB per block; fp8 mma.sync"),
    _cuda("sm_90", 227, _WGMMA_E4M3, _WGMMA_F16, "H100/H200, 227 KB per block; wgmma"),
    _cuda("sm_100", 227, _TCGEN05_F8, _TCGEN05_F16, "B200, 227 KB per block; tcgen05"),
    _cuda("sm_103", 227, _TCGEN05_F8, _TCGEN05_F16, "B300, 227 KB per block; tcgen05"),
    _cuda("sm_120", 99, _MMA_E4M3, _MMA_F16, "RTX 50/RTX PRO 6000, 99 KB per block; fp8 mma.sync, no wgmma"),
    _rocm("gfx90a", 64, None, None, "MI250X (CDNA2), 64 KiB LDS, no fp8 MFMA"),
    _rocm("gfx942", 64, "e4m3fnuz", r"^v_mfma_f32_\w+_fp8_fp8", "MI300X (CDNA3), 64 KiB LDS, fp8 MFMA on FNUZ"),
    _rocm("gfx950", 160, "e4m3fn", r"^v_mfma_f32_\w+_(fp8_fp8|f8f6f4)",
          "MI355X (CDNA4), 160 KiB LDS, fp8 MFMA on OCP"),
)}
# fmt: on

# The architectures CI compiles every selected kernel for.
PREFLIGHT_ARCHS = tuple(ARCH_LIMITS)

_ARCH_RE = re.compile(r"^(sm_(\d+?)(\d)|gfx(\d+?)([0-9a-f])([0-9a-f]))$")


def arch_limits(arch: str) -> ArchLimits | None:
    """The row for `arch`, or the closest older row of the same family (same CUDA major, or
    same gfx major and minor); None when the family has no row."""
    arch = arch.strip().lower()
    if arch in ARCH_LIMITS:
        return ARCH_LIMITS[arch]
    family = [a for a in ARCH_LIMITS if _family(a) == _family(arch) and _family(a) is not None]
    older = [a for a in family if _order(a) <= _order(arch)]
    return ARCH_LIMITS[max(older, key=_order)] if older else None


def _family(arch: str) -> str | None:
    m = _ARCH_RE.match(arch)
    if m is None:
        return None
    return f"sm_{m.group(2)}" if m.group(2) else f"gfx{m.group(4)}{m.group(5)}"


def _order(arch: str) -> int:
    m = _ARCH_RE.match(arch)
    assert m is not None
    return int(m.group(3)) if m.group(2) else int(m.group(6), 16)
