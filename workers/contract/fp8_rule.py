"""The fp8 rule: which convention a device gets, decided in one torch-free place.

Native e4m3 at or above `NATIVE_FP8_CAPABILITY` on CUDA (fp8 tensor cores); on ROCm, native
on the architectures with fp8 matrix cores, in the encoding those cores take: e4m3fnuz on
CDNA3 (gfx94x), OCP e4m3fn from CDNA4 (gfx950, MI355); emulated (e4m3 bytes stored as uint8
and dequantized for the matmul) everywhere else. `workers.quant.fp8_convention.choose_fp8`
turns the decision into the worker's `Fp8Convention` (buffer dtypes), `kernels_local.mapping`
draws its `Fp8Linear` capability ranges from the same thresholds, and `hetserve plan` shows
it: all three read this module, so the host's buffers and the kernel's compile-time flag
cannot come from two different rules. Importing it costs nothing (no torch), which is why the
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
        return Fp8Decision(EMULATED, "e4m3fn",
                           "CPU without a GPU capability: e4m3 bytes stored as uint8 and dequantized")
    raise ValueError(f"Unsupported device type `{device_type}`. Supported: {', '.join(DEVICE_TYPES)}")


# -- pre-quantized fp8 checkpoints: which execution a device runs them with -----------------------

# Triton's tensor-core dots (mma.sync) start at sm_80: the weight-only GEMM's floor on CUDA.
WEIGHT_ONLY_FP8_CAPABILITY = Capability(8, 0)
FP8_NATIVE, FP8_WEIGHT_ONLY, FP8_DEQUANTIZED = "native", "weight_only", "dequantized"
FP8_EXECUTIONS = (FP8_NATIVE, FP8_WEIGHT_ONLY, FP8_DEQUANTIZED)


@dataclass(frozen=True)
class Fp8Execution:
    """How a device runs a pre-quantized fp8 checkpoint's linear layers, in which e4m3 flavour, and why.

    `native`: fp8 GEMM, activations quantized on the fly (per token, per 128-group, or with the
    checkpoint's static scale); `weight_only`: e4m3 bytes kept in memory and dequantized inside a
    16-bit GEMM (W8A16), activations untouched; `dequantized`: weights widened once to the model
    dtype at load for a plain matmul (the memory saving is lost, and said so)."""

    kind: str
    fmt: str  # the e4m3 flavour the device's bytes are kept in ("e4m3fn" | "e4m3fnuz")
    reason: str

    @property
    def keeps_fp8_bytes(self) -> bool:
        return self.kind != FP8_DEQUANTIZED


def fp8_execution(device_type: str, capability) -> Fp8Execution:
    """The execution of an fp8 checkpoint on one device, from the same rule as its fp8 convention:
    native where `fp8_rule` is native; weight-only on GPUs with 16-bit tensor cores that Triton
    drives (CUDA from sm_80, every ROCm arch); dequantized below sm_80 and on CPU. Pure."""
    decision = fp8_rule(device_type, capability)  # raises for an unknown device type
    cap = Capability.parse_optional(capability)
    shown = "none" if cap is None else cap.label
    if decision.native:
        return Fp8Execution(FP8_NATIVE, decision.fmt, f"{decision.reason}: native fp8 GEMM on the checkpoint's "
                                                      f"{decision.fmt} bytes, activations quantized on the fly")
    if device_type == "cuda" and cap is not None and cap >= WEIGHT_ONLY_FP8_CAPABILITY:
        return Fp8Execution(FP8_WEIGHT_ONLY, decision.fmt,
                            f"capability {shown} < {NATIVE_FP8_CAPABILITY.label} (no fp8 tensor cores) but >= "
                            f"{WEIGHT_ONLY_FP8_CAPABILITY.label}: weight-only, e4m3 bytes kept in memory and "
                            "dequantized inside a 16-bit tensor-core GEMM (W8A16); activations not quantized")
    if device_type == "rocm":
        return Fp8Execution(FP8_WEIGHT_ONLY, decision.fmt,
                            f"ROCm arch {shown} without fp8 matrix cores: weight-only, the bytes turned into "
                            "e4m3fnuz and dequantized inside a 16-bit MFMA GEMM (W8A16)")
    where = "CPU" if device_type == "cpu" else f"capability {shown} < {WEIGHT_ONLY_FP8_CAPABILITY.label}"
    return Fp8Execution(FP8_DEQUANTIZED, decision.fmt,
                        f"{where}: no tensor-core GEMM that reads fp8 bytes, so the weights are dequantized once "
                        "at load into the model dtype (memory widened) for the plain matmul")
