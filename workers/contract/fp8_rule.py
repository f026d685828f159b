"""The fp8 rule: which convention a device gets, decided in one torch-free place.

Native e4m3 at or above `NATIVE_FP8_CAPABILITY` on CUDA (fp8 tensor cores); on ROCm, native
on the architectures with fp8 matrix cores, in the encoding those cores take: e4m3fnuz on
CDNA3 (gfx94x), OCP e4m3fn from CDNA4 (gfx950, MI355); emulated (e4m3 bytes stored as uint8
and dequantized for the matmul) everywhere else. `workers.fp8.convention.choose_fp8` turns the decision
into the worker's `Fp8Convention` (buffer dtypes), `kernels_local.mapping` draws its
`Fp8Linear` capability ranges from the same thresholds, and `hetserve plan` shows it: all
three read this module, so the host's buffers and the kernel's compile-time flag cannot
come from two different rules. Importing it costs nothing (no torch), which is why the
router's `plan` can show the decision without loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.contract.capability import Capability

NATIVE_FP8_CAPABILITY = Capability(8, 9)
# ROCm capabilities read from the arch (gfx942 -> 9.4): CDNA3 and later have fp8 matrix cores.
ROCM_NATIVE_FP8_CAPABILITY = Capability(9, 4)
# CDNA4 (gfx950 -> 9.5) and later take the OCP encoding (e4m3fn); CDNA3 takes FNUZ.
ROCM_OCP_FP8_CAPABILITY = Capability(9, 5)
ROCM_NATIVE_FP8_LAST = Capability(9, 9)  # gfx10+ (RDNA) is not CDNA: no fp8 matrix cores

NATIVE, EMULATED = "native_e4m3", "emulated"
FP8_CONVENTIONS = (NATIVE, EMULATED)
DEVICE_TYPES = ("cuda", "rocm", "cpu")


@dataclass(frozen=True)
class Fp8Decision:
    """A device's fp8 convention (`native_e4m3` | `emulated`), e4m3 flavour and the reason."""

    convention: str
    fmt: str  # "e4m3fn" (OCP: NVIDIA, AMD CDNA4) | "e4m3fnuz" (AMD CDNA3)
    reason: str

    @property
    def native(self) -> bool:
        return self.convention == NATIVE


def fp8_rule(device_type: str, capability) -> Fp8Decision:
    """The fp8 decision for one device. Pure; `capability` in any `Capability.parse` spelling."""
    cap = Capability.parse_optional(capability)
    shown = "none" if cap is None else cap.label
    floor = NATIVE_FP8_CAPABILITY.label
    if device_type == "cuda":
        if cap is not None and cap >= NATIVE_FP8_CAPABILITY:
            return Fp8Decision(NATIVE, "e4m3fn",
                               f"capability {shown} >= {floor}: fp8 tensor cores, e4m3fn storage and native fp8 matmul")
        return Fp8Decision(EMULATED, "e4m3fn", f"capability {shown} < {floor}: no fp8 tensor cores, "
                                               "e4m3 bytes stored as uint8 and dequantized for the matmul")
    if device_type == "rocm":
        if cap is not None and ROCM_OCP_FP8_CAPABILITY <= cap <= ROCM_NATIVE_FP8_LAST:
            return Fp8Decision(NATIVE, "e4m3fn", f"ROCm arch {shown} (CDNA4+): fp8 matrix cores on the OCP "
                                                 "encoding, float8_e4m3fn storage")
        if cap is not None and ROCM_NATIVE_FP8_CAPABILITY <= cap <= ROCM_NATIVE_FP8_LAST:
            return Fp8Decision(NATIVE, "e4m3fnuz", f"ROCm arch {shown} (CDNA3): fp8 matrix cores on the FNUZ "
                                                   "encoding, float8_e4m3fnuz storage")
        return Fp8Decision(EMULATED, "e4m3fnuz",
                           f"ROCm arch {shown}: no fp8 matrix cores, e4m3fnuz bytes stored as uint8 and dequantized")
    if device_type == "cpu":
        return Fp8Decision(EMULATED, "e4m3fn", "CPU without a GPU capability: e4m3 bytes stored as uint8 and dequantized")
    raise ValueError(f"Unsupported device type `{device_type}`. Supported: {', '.join(DEVICE_TYPES)}")
