"""The kernel mapping: which local kernel layer each model layer gets on which device.

ONE table (`_ENTRIES`) declares, per model layer, a kernel layer for every device type (`kernels`'
`Device` with `CUDAProperties` / `ROCMProperties` capability ranges); `kernel_mapping()` builds it
in the shape `kernels.use_kernel_mapping` takes, merging entries per layer and refusing a
duplicate (layer, device). `select(device_type, capability)` resolves it the way `kernels` does
(the smallest capability interval wins) but as a pure function: no current device, no cache, so
simulation and real GPUs run the same selection code and the worker kernelizes with exactly its
choices. It imports neither torch nor the kernel repositories, only the torch-free contract (the
fp8 rule's thresholds), so the router's `plan` stays light; the trade-off: layer classes are named
as strings, which a test loads through `kernels`.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kernels import CUDAProperties, Device, LocalLayerRepository, ROCMProperties

from workers.contract import (
    ACCEPTED_CAPABILITY_SPELLINGS,
    DEVICE_TYPES,
    EMULATED,
    FP8_DEQUANTIZED,
    FP8_NATIVE,
    FP8_WEIGHT_ONLY,
    NATIVE,
    NATIVE_FP8_CAPABILITY,
    ROCM_NATIVE_FP8_CAPABILITY,
    ROCM_NATIVE_FP8_LAST,
    ROCM_OCP_FP8_CAPABILITY,
    WEIGHT_ONLY_FP8_CAPABILITY,
    Capability,
    CapabilityError,
)

REPO_ROOT = Path(__file__).resolve().parent
LAYERS = ("RMSNorm", "SiluAndMul", "Fp8Linear", "PagedAttention", "FusedMoE", "Fp8CheckpointLinear", "GatedDeltaRule",
          "Fp8FusedMoE", "Int4CheckpointLinear", "Mxfp4FusedMoE", "LoraDelta", "GGUFLinear", "GGUFExperts")

# Open upper bound of a capability range (what `kernels` uses for a Device without properties).
_ANY = sys.maxsize
# fp8 convention thresholds as `kernels` capability integers, from the one fp8 rule
# (`workers.contract.fp8_rule`: native e4m3 from sm_89; on ROCm e4m3fnuz on CDNA3, OCP e4m3fn from
# CDNA4). Each fp8 entry names the convention it was built for (`KernelChoice.fp8`), which the
# quantizer compares with the worker's; a test checks both agree for every capability.
_FP8_NATIVE_CUDA = NATIVE_FP8_CAPABILITY.int  # 89
_FP8_FNUZ_ROCM = (ROCM_NATIVE_FP8_CAPABILITY.int, ROCM_OCP_FP8_CAPABILITY.int - 1)  # CDNA3 (gfx94x)
_FP8_OCP_ROCM = (ROCM_OCP_FP8_CAPABILITY.int, ROCM_NATIVE_FP8_LAST.int)  # CDNA4+ (gfx950)
_FP8_WEIGHT_ONLY_CUDA = WEIGHT_ONLY_FP8_CAPABILITY.int  # 80


@dataclass(frozen=True)
class KernelChoice:
    """One layer's kernel for one device, with the reason it was chosen."""

    repo: str  # repository directory, relative to the project ("kernels_local/rmsnorm")
    layer: str  # layer class inside the repository's `layers`
    variant: str  # tuning / convention variant ("triton-sm90", "native_e4m3-triton", "torch")
    reason: str
    # the fp8 convention an `Fp8Linear` kernel is built for, or the execution of an `Fp8CheckpointLinear`
    # one (native | weight_only | dequantized); None for other layers
    fp8: str | None = None

    def to_dict(self) -> dict:
        """`/workers` `kernels` entry: repo, layer, variant, reason."""
        return {k: v for k, v in asdict(self).items() if k != "fp8"}

    def repository(self) -> LocalLayerRepository:
        """The `kernels` repository object that loads this layer."""
        return LocalLayerRepository(repo_path=REPO_ROOT / Path(self.repo).name, layer_name=self.layer)


@dataclass(frozen=True)
class _Entry:
    layer: str  # the model's layer name (its `use_kernel_forward_from_hub` name)
    device: Device
    repo: str  # directory under kernels_local/
    layer_class: str
    variant: str
    why: str
    fp8: str | None = None


def _cuda(lo: int, hi: int) -> Device:
    return Device(type="cuda", properties=CUDAProperties(min_capability=lo, max_capability=hi))


def _rocm(lo: int, hi: int) -> Device:
    return Device(type="rocm", properties=ROCMProperties(min_capability=lo, max_capability=hi))


_NEWER = ("newer than the newest tuned architecture (sm_90): its Hopper tuning, the nearest, on forward-compatible "
          "Triton code")

_RDNA = "RDNA (gfx10+) runs the CDNA tuning: correct, with fewer warps than its 32-lane waves would like"

_CPU_CPP = ("CPU: C++, one pass per row in ATen's vectors for this CPU's ISA (the torch reference under "
            "torch.compile, which fuses it, and where the kernel cannot build)")

_BELOW_SM70 = "below sm_70, which Triton does not target: the torch reference"

_CDNA_TUNING = "Triton tuned for CDNA's 64-lane wavefronts"


def _triton_family(layer: str, repo: str, cls: str, cpu: str, below: str, sm70: str, sm90: str,
                   rocm: str, first: int = 70, cpu_kernel: tuple[str, str] | None = None) -> tuple[_Entry, ...]:
    """The seven entries of a layer with the usual Triton family: the torch reference on CPU (or
    `cpu_kernel`'s (class, variant)) and below sm_`first` (sm_70 unless the layer's kernel needs
    more), `<cls>TritonSm70` up to Ada, `<cls>TritonSm90` from Hopper on, `<cls>TritonRocm`."""
    cpu_cls, cpu_variant = cpu_kernel or (cls, "torch")
    return (
        _Entry(layer, Device(type="cpu"), repo, cpu_cls, cpu_variant, cpu),
        _Entry(layer, Device(type="cuda"), repo, cls, "torch", below),
        _Entry(layer, _cuda(first, 89), repo, f"{cls}TritonSm70", "triton-sm70", sm70),
        _Entry(layer, _cuda(90, 99), repo, f"{cls}TritonSm90", "triton-sm90", sm90),
        _Entry(layer, _cuda(100, _ANY), repo, f"{cls}TritonSm90", "triton-sm90", _NEWER),
        _Entry(layer, Device(type="rocm"), repo, f"{cls}TritonRocm", "triton-rocm", rocm),
        _Entry(layer, _rocm(100, _ANY), repo, f"{cls}TritonRocm", "triton-rocm", _RDNA),
    )

def _gguf_family(layer: str, cls: str, cpu_kernel: tuple[str, str], cpu: str, run: str,
                 tiles: dict[str, str]) -> tuple[_Entry, ...]:  # fmt: skip
    """The eight entries of a GGUF layer (the GGUF rule's ranges): `cpu_kernel` on the CPU, `cls` (blocks
    dequantized at load) below sm_70, `<cls>Triton<tuning>` per family from sm_70, `run` with its `tiles`."""
    packed = "GGUF blocks kept packed, decoded in registers; " + run

    def triton(capability: Device, tuning: str, why: str) -> _Entry:
        return _Entry(layer, capability, "gguf_linear", f"{cls}Triton{tuning.title()}", f"triton-{tuning}", why)

    return (
        _Entry(layer, Device(type="cpu"), "gguf_linear", *cpu_kernel, cpu),
        _Entry(layer, Device(type="cuda"), "gguf_linear", cls, "torch",
               "below sm_70, which Triton does not target: GGUF blocks dequantized at load, cuBLAS matmul"),
        triton(_cuda(70, 79), "sm70", f"Volta/Turing (sm_70..sm_79): {packed}, {tiles['sm70']}"),
        triton(_cuda(80, 89), "sm80", f"Ampere/Ada (sm_80..sm_89): {packed}, {tiles['sm80']}"),
        triton(_cuda(90, 99), "sm90", f"Hopper (sm_90): {packed}, {tiles['sm90']}"),
        triton(_cuda(100, _ANY), "sm90", f"{packed}, {tiles['sm90']}; {_NEWER}"),
        triton(Device(type="rocm"), "rocm", f"{packed}, {tiles['rocm']}"),
        triton(_rocm(100, _ANY), "rocm", f"{packed}, {tiles['rocm']}; {_RDNA}"),
    )

# fmt: off
_ENTRIES: tuple[_Entry, ...] = (
    *_triton_family(
        "RMSNorm", "rmsnorm", "RMSNorm", _CPU_CPP, _BELOW_SM70,
        "pre-Hopper (sm_70..sm_89): Triton, one row per program, 8 elements per thread",
        "Hopper (sm_90): Triton, several narrow rows per program, 16 elements per thread",
        _CDNA_TUNING, cpu_kernel=("RMSNormCpu", "cpp")),
    *_triton_family(
        "SiluAndMul", "activation", "SiluAndMul", _CPU_CPP, _BELOW_SM70,
        "pre-Hopper (sm_70..sm_89): Triton, 1024 columns x 4 warps per program",
        "Hopper (sm_90): Triton, 4096 columns x 8 warps per program",
        _CDNA_TUNING, cpu_kernel=("SiluAndMulCpu", "cpp")),
    # -- Fp8Linear (ranges and convention from the fp8 rule) --------------------------------
    _Entry("Fp8Linear", Device(type="cpu"), "fp8_linear", "Fp8Linear", "emulated-torch",
           "CPU: emulated fp8, uint8 weights dequantized for a torch matmul", EMULATED),
    _Entry("Fp8Linear", Device(type="cuda"), "fp8_linear", "Fp8Linear", "emulated-torch",
           "below sm_80 (no fp8 tensor cores, Triton dots need sm_80): emulated, dequantize + cuBLAS matmul",
           EMULATED),
    _Entry("Fp8Linear", _cuda(80, _FP8_NATIVE_CUDA - 1), "fp8_linear", "Fp8LinearTritonEmulatedSm80",
           "emulated-triton", "sm_80..sm_88 lack fp8 tensor cores: Triton NATIVE=False, uint8 weights "
           "decoded in registers, fp16 mma", EMULATED),
    _Entry("Fp8Linear", _cuda(_FP8_NATIVE_CUDA, 89), "fp8_linear", "Fp8LinearTritonNativeSm89",
           "native_e4m3-triton", "Ada (sm_89) has fp8 tensor cores: Triton NATIVE=True, e4m3 mma, 3 stages", NATIVE),
    _Entry("Fp8Linear", _cuda(90, 99), "fp8_linear", "Fp8LinearTritonNativeSm90", "native_e4m3-triton",
           "Hopper (sm_90) fp8 tensor cores: Triton NATIVE=True, 128-wide tiles, 4 stages", NATIVE),
    _Entry("Fp8Linear", _cuda(100, _ANY), "fp8_linear", "Fp8LinearTritonNativeSm90", "native_e4m3-triton",
           f"fp8 tensor cores, NATIVE=True; {_NEWER}", NATIVE),
    _Entry("Fp8Linear", Device(type="rocm"), "fp8_linear", "Fp8LinearTritonEmulatedRocm", "emulated-triton",
           "ROCm arch without fp8 matrix cores: Triton NATIVE=False, e4m3fnuz bytes decoded in registers", EMULATED),
    _Entry("Fp8Linear", _rocm(*_FP8_FNUZ_ROCM), "fp8_linear", "Fp8LinearTritonNativeRocm", "native_e4m3-triton",
           "CDNA3 (gfx94x) fp8 matrix cores: Triton NATIVE=True on e4m3fnuz", NATIVE),
    _Entry("Fp8Linear", _rocm(*_FP8_OCP_ROCM), "fp8_linear", "Fp8LinearTritonNativeRocm", "native_e4m3-triton",
           "CDNA4 (gfx950) fp8 matrix cores: Triton NATIVE=True on OCP e4m3fn (not fnuz)", NATIVE),
    *_triton_family(
        "PagedAttention", "paged_attention", "PagedAttention",
        "CPU: the rows' blocks gathered, one SDPA (Triton needs a GPU)",
        "below sm_70, which Triton does not target: gathered blocks and SDPA",
        "pre-Hopper (sm_70..sm_89): Triton reads blocks in place through the block table, 64-position tiles, 4 warps "
        "(more for wide heads, 16 at head dim 512)",
        "Hopper (sm_90): Triton reads blocks in place, up to 128-position tiles, 8 warps (16 at head dim 512)",
        "Triton reading blocks in place, tuned for CDNA's 64-lane wavefronts"),
    # -- FusedMoE: Triton from sm_80 (a grouped GEMM: below sm_80 Triton's dots are FMAs) -------
    *_triton_family(
        "FusedMoE", "fused_moe", "FusedMoE",
        "CPU: pairs grouped by expert; a CPU worker's packed experts through a C++ loop (brgemm over column "
        "panels, oneDNN packs past a reduction of 2048), else one grouped GEMM per projection "
        "(torch._grouped_mm); Triton needs a GPU",
        "below sm_80 Triton lowers dots to FMAs (no mma; the grouped GEMM spills), while cuBLAS has tensor "
        "cores: one torch matmul pair per active expert",
        "Ampere/Ada (sm_80..sm_89): Triton grouped GEMM over expert-aligned blocks, 16-row decode / 64-row "
        "prefill blocks, 4 warps, mma.sync",
        "Hopper (sm_90): Triton grouped GEMM over expert-aligned blocks of 64 rows or more (wgmma), "
        "128 x 64 prefill tiles over 8 warps",
        "Triton grouped GEMM over expert-aligned blocks, tuned for CDNA's 64 KiB of LDS (2 stages)",
        first=80),
    # -- GatedDeltaRule (Qwen3.5 / Qwen3-Next linear layers): the state stays in registers -----
    *_triton_family(
        "GatedDeltaRule", "gated_delta", "GatedDeltaRule",
        "CPU: torch, decode rows one recurrent step each, prefill spans chunked (64 tokens, a triangular solve)",
        "below sm_70, which Triton does not target: the torch recurrent and chunked forms",
        "pre-Hopper (sm_70..sm_89): Triton, 16-token chunks over 32 of the state's columns per program, the "
        "key dim in 16-wide blocks (fp32 ieee dots), one-step decode kernel, 4 warps",
        "Hopper (sm_90): Triton, 16-token chunks over 32 of the state's columns per program, the key dim in "
        "16-wide blocks (fp32 ieee dots), one-step decode kernel, 16 warps",
        "Triton, 16-token chunks over 64 of the state's columns per program, the key dim in 32-wide blocks "
        "(fp32 MFMA), tuned for CDNA's 64-lane wavefronts"),
    # -- Fp8CheckpointLinear: pre-quantized checkpoints, the execution from the fp8 rule --------
    _Entry("Fp8CheckpointLinear", Device(type="cpu"), "fp8_linear", "Fp8CheckpointLinear", "dequantized-torch",
           "CPU: the checkpoint's fp8 weights dequantized once at load into the model dtype, torch matmul",
           FP8_DEQUANTIZED),
    _Entry("Fp8CheckpointLinear", Device(type="cuda"), "fp8_linear", "Fp8CheckpointLinear", "dequantized-torch",
           "below sm_80 (no Triton mma): the fp8 weights dequantized at load into the model dtype, cuBLAS matmul",
           FP8_DEQUANTIZED),
    _Entry("Fp8CheckpointLinear", _cuda(_FP8_WEIGHT_ONLY_CUDA, _FP8_NATIVE_CUDA - 1), "fp8_linear",
           "Fp8CheckpointLinearTritonW8A16Sm80", "weight_only-triton",
           "sm_80..sm_88 lack fp8 tensor cores: Triton W8A16, e4m3 bytes kept and decoded in registers, "
           "16-bit mma, activations not quantized", FP8_WEIGHT_ONLY),
    _Entry("Fp8CheckpointLinear", _cuda(_FP8_NATIVE_CUDA, 89), "fp8_linear", "Fp8CheckpointLinearTritonNativeSm89",
           "native_e4m3-triton", "Ada (sm_89) fp8 tensor cores: Triton per-channel or 128x128 block-scaled fp8 "
           "GEMM, activations quantized per token or token group", FP8_NATIVE),
    _Entry("Fp8CheckpointLinear", _cuda(90, 99), "fp8_linear", "Fp8CheckpointLinearTritonNativeSm90",
           "native_e4m3-triton", "Hopper (sm_90) fp8 tensor cores: Triton per-channel or block-scaled fp8 GEMM, "
           "128-wide tiles (wgmma)", FP8_NATIVE),
    _Entry("Fp8CheckpointLinear", _cuda(100, _ANY), "fp8_linear", "Fp8CheckpointLinearTritonNativeSm90",
           "native_e4m3-triton", f"fp8 tensor cores, native fp8 GEMM; {_NEWER}", FP8_NATIVE),
    _Entry("Fp8CheckpointLinear", Device(type="rocm"), "fp8_linear", "Fp8CheckpointLinearTritonW8A16Rocm",
           "weight_only-triton", "ROCm arch without fp8 matrix cores: Triton W8A16 on e4m3fnuz bytes, 16-bit MFMA",
           FP8_WEIGHT_ONLY),
    _Entry("Fp8CheckpointLinear", _rocm(*_FP8_FNUZ_ROCM), "fp8_linear", "Fp8CheckpointLinearTritonNativeRocm",
           "native_e4m3-triton", "CDNA3 (gfx94x) fp8 matrix cores: the checkpoint's e4m3fn bytes read as "
           "e4m3fnuz, scales doubled, -0 to 0; native fp8 GEMM", FP8_NATIVE),
    _Entry("Fp8CheckpointLinear", _rocm(*_FP8_OCP_ROCM), "fp8_linear", "Fp8CheckpointLinearTritonNativeRocm",
           "native_e4m3-triton", "CDNA4 (gfx950) fp8 matrix cores on OCP e4m3fn: the checkpoint's bytes as stored, "
           "native fp8 GEMM", FP8_NATIVE),
    # -- Fp8FusedMoE: a checkpoint's fp8 experts, the same execution as its linear layers --------
    _Entry("Fp8FusedMoE", Device(type="cpu"), "fused_moe", "Fp8FusedMoE", "dequantized-torch",
           "CPU: the fp8 experts dequantized once at load into the model dtype, one torch matmul pair per active "
           "expert", FP8_DEQUANTIZED),
    _Entry("Fp8FusedMoE", Device(type="cuda"), "fused_moe", "Fp8FusedMoE", "dequantized-torch",
           "below sm_80 (no Triton mma): the fp8 experts dequantized at load, one cuBLAS matmul pair per active "
           "expert", FP8_DEQUANTIZED),
    _Entry("Fp8FusedMoE", _cuda(_FP8_WEIGHT_ONLY_CUDA, _FP8_NATIVE_CUDA - 1), "fused_moe",
           "Fp8FusedMoETritonW8A16Sm80", "weight_only-triton", "sm_80..sm_88 lack fp8 tensor cores: Triton grouped "
           "GEMM on the experts' e4m3 bytes decoded in registers, 16-bit mma, activations not quantized",
           FP8_WEIGHT_ONLY),
    _Entry("Fp8FusedMoE", _cuda(_FP8_NATIVE_CUDA, 89), "fused_moe", "Fp8FusedMoETritonNativeSm89",
           "native_e4m3-triton", "Ada (sm_89) fp8 tensor cores: Triton grouped fp8 GEMM, activations quantized "
           "per token or token group, pre-Hopper tiles", FP8_NATIVE),
    _Entry("Fp8FusedMoE", _cuda(90, 99), "fused_moe", "Fp8FusedMoETritonNativeSm90", "native_e4m3-triton",
           "Hopper (sm_90) fp8 tensor cores: Triton grouped fp8 GEMM, 64-row blocks or more", FP8_NATIVE),
    _Entry("Fp8FusedMoE", _cuda(100, _ANY), "fused_moe", "Fp8FusedMoETritonNativeSm90", "native_e4m3-triton",
           f"fp8 tensor cores, grouped fp8 GEMM; {_NEWER}", FP8_NATIVE),
    _Entry("Fp8FusedMoE", Device(type="rocm"), "fused_moe", "Fp8FusedMoETritonW8A16Rocm", "weight_only-triton",
           "ROCm arch without fp8 matrix cores: Triton grouped GEMM on e4m3fnuz bytes, 16-bit MFMA", FP8_WEIGHT_ONLY),
    _Entry("Fp8FusedMoE", _rocm(*_FP8_FNUZ_ROCM), "fused_moe", "Fp8FusedMoETritonNativeRocm", "native_e4m3-triton",
           "CDNA3 (gfx94x) fp8 matrix cores: the experts' bytes read as e4m3fnuz, scales doubled; grouped fp8 GEMM",
           FP8_NATIVE),
    _Entry("Fp8FusedMoE", _rocm(*_FP8_OCP_ROCM), "fused_moe", "Fp8FusedMoETritonNativeRocm", "native_e4m3-triton",
           "CDNA4 (gfx950) fp8 matrix cores on OCP e4m3fn: grouped fp8 GEMM on the bytes as stored", FP8_NATIVE),
    # -- Int4CheckpointLinear: GPTQ / AWQ / pack-quantized layers, the ranges of the 4-bit rule -------
    #    (workers/quant/int4_methods.py `int4_execution`; the variant's first word is its execution)
    _Entry("Int4CheckpointLinear", Device(type="cpu"), "int4_linear", "Int4CheckpointLinear", "packed-torch",
           "CPU: 4-bit weights kept packed, each layer dequantized per call (exact, in its scales' dtype) for an "
           "fp32 torch matmul"),
    _Entry("Int4CheckpointLinear", Device(type="cuda"), "int4_linear", "Int4CheckpointLinearDequantized",
           "dequantized-torch", "below sm_75 Triton has no 16-bit mma for the W4A16 GEMM: 4-bit weights "
           "dequantized at load into the model dtype, cuBLAS matmul"),
    _Entry("Int4CheckpointLinear", _cuda(75, 79), "int4_linear", "Int4LinearTritonSm75", "w4a16-triton-sm75",
           "Turing (sm_75): Triton W4A16, nibbles unpacked in registers, fp16 mma, 2 stages in 64 KB"),
    _Entry("Int4CheckpointLinear", _cuda(80, 89), "int4_linear", "Int4LinearTritonSm80", "w4a16-triton-sm80",
           "Ampere/Ada (sm_80..sm_89): Triton W4A16, nibbles unpacked in registers, 16-bit mma, 3 stages"),
    _Entry("Int4CheckpointLinear", _cuda(90, 99), "int4_linear", "Int4LinearTritonSm90", "w4a16-triton-sm90",
           "Hopper (sm_90): Triton W4A16, nibbles unpacked in registers, 128-wide tiles over 8 warps"),
    _Entry("Int4CheckpointLinear", _cuda(100, _ANY), "int4_linear", "Int4LinearTritonSm90", "w4a16-triton-sm90",
           f"Triton W4A16; {_NEWER}"),
    _Entry("Int4CheckpointLinear", Device(type="rocm"), "int4_linear", "Int4LinearTritonRocm", "w4a16-triton-rocm",
           "Triton W4A16, nibbles unpacked in registers, 16-bit MFMA, tuned for CDNA's 64-lane wavefronts"),
    _Entry("Int4CheckpointLinear", _rocm(100, _ANY), "int4_linear", "Int4LinearTritonRocm", "w4a16-triton-rocm",
           f"Triton W4A16; {_RDNA}"),
    # -- GGUFLinear / GGUFExperts: a GGUF file's blocks, the ranges of the GGUF rule (workers/gguf/execution.py) ----
    *_gguf_family("GGUFLinear", "GGUFLinear", ("GGUFLinearCpu", "cpp-gemv"),
                  "CPU: Q8_0/Q4_0/Q4_K/Q5_K/Q6_K blocks kept packed, a C++ GEMV decoding them in registers (a "
                  "prompt's rows: torch matmul on panels dequantized per call); other types dequantized at load",
                  "Triton GEMV (decode) and GEMM (prefill", {
                      "sm70": "tiles of at most 32 rows), 2 stages", "sm80": "16-bit mma, 64-row tiles), 2 stages",
                      "sm90": "128-wide tiles over 8 warps)", "rocm": "tuned for CDNA's 64-lane wavefronts)"}),
    *_gguf_family("GGUFExperts", "GGUFExperts", ("GGUFExpertsCpu", "cpp-gemv"),
                  "CPU: a MoE layer's Q8_0/Q4_0/Q4_K/Q5_K/Q6_K experts kept packed, each active expert's projections "
                  "through the C++ GEMV",
                  "Triton grouped GEMM over every active expert (16-row decode blocks; prefill", {
                      "sm70": "32 x 32 tiles, 8 warps)", "sm80": "64 x 32 tiles, 8 warps, 16-bit mma)",
                      "sm90": "16 x 32 tiles, 8 warps)", "rocm": "64 x 64 tiles, 4 wavefronts)"}),
    # -- Mxfp4FusedMoE: gpt-oss's MXFP4 experts, the ranges of the MXFP4 rule (workers/contract/mxfp4_rule.py
    #    `mxfp4_kind`, held equal by a test; the variant's first word is the execution; a dequantizing device
    #    holds no such module: its experts were widened at load into FusedMoE) ---------------------------
    _Entry("Mxfp4FusedMoE", Device(type="cpu"), "fused_moe", "Mxfp4FusedMoE", "dequantized-torch",
           "CPU: MXFP4 experts dequantized at load into the model dtype, then FusedMoE (Triton needs a GPU)"),
    _Entry("Mxfp4FusedMoE", Device(type="cuda"), "fused_moe", "Mxfp4FusedMoE", "dequantized-torch",
           "below sm_80 the grouped GEMM does not run in Triton (dots lower to FMAs): MXFP4 experts "
           "dequantized at load into the model dtype, then FusedMoE"),
    _Entry("Mxfp4FusedMoE", _cuda(80, 89), "fused_moe", "Mxfp4FusedMoETritonSm80",
           "w4a16-triton-sm80", "Ampere/Ada (sm_80..sm_89): MXFP4 experts kept packed, e2m1 decoded in registers in "
           "the Triton grouped GEMM, 16-bit mma, pre-Hopper tiles"),
    _Entry("Mxfp4FusedMoE", _cuda(90, 99), "fused_moe", "Mxfp4FusedMoETritonSm90", "w4a16-triton-sm90",
           "Hopper (sm_90): MXFP4 experts kept packed, e2m1 decoded in registers in the Triton grouped GEMM, "
           "64-row blocks or more (wgmma)"),
    _Entry("Mxfp4FusedMoE", _cuda(100, _ANY), "fused_moe", "Mxfp4FusedMoETritonSm90", "w4a16-triton-sm90",
           f"MXFP4 experts kept packed, Triton grouped GEMM; {_NEWER}"),
    _Entry("Mxfp4FusedMoE", Device(type="rocm"), "fused_moe", "Mxfp4FusedMoETritonRocm", "w4a16-triton-rocm",
           "MXFP4 experts kept packed, e2m1 decoded in registers in the Triton grouped GEMM, 16-bit MFMA, tuned "
           "for CDNA's 64-lane wavefronts"),
    _Entry("Mxfp4FusedMoE", _rocm(100, _ANY), "fused_moe", "Mxfp4FusedMoETritonRocm", "w4a16-triton-rocm",
           f"MXFP4 experts kept packed, Triton grouped GEMM; {_RDNA}"),
    # -- LoraDelta: the LoRA adapters of a mixed batch, every adapter of a step in one launch pair -----
    *_triton_family(
        "LoraDelta", "lora_sgmv", "LoraDelta",
        "CPU: torch, one gather, two thin matmuls and a scatter per adapter present (Triton needs a GPU)",
        _BELOW_SM70,
        "pre-Hopper (sm_70..sm_89): Triton segmented shrink/expand over the step's stacked adapters (SGMV tiles "
        "up to 32 rows, one row per program for short decode segments), 4 warps",
        "Hopper (sm_90): Triton segmented shrink/expand over the step's stacked adapters, 64-wide K blocks, 128 "
        "columns, SGMV tiles up to 64 rows over 8 warps",
        "Triton segmented shrink/expand over the step's stacked adapters, tuned for CDNA's 64 KiB of LDS"),
)
# fmt: on


def _declare(entries: tuple[_Entry, ...]) -> dict[str, dict[Device, LocalLayerRepository]]:
    """`{layer: {Device: LocalLayerRepository}}`, every device type of every layer kept."""
    mapping: dict[str, dict[Device, LocalLayerRepository]] = {}
    for e in entries:
        per_device = mapping.setdefault(e.layer, {})  # merge: never replace a layer's devices
        if e.device in per_device:
            raise ValueError(f"Duplicate kernel mapping entry for `{e.layer}` on `{e.device}`")
        per_device[e.device] = LocalLayerRepository(repo_path=REPO_ROOT / e.repo, layer_name=e.layer_class)
    return mapping


def kernel_mapping() -> dict[str, dict[Device, LocalLayerRepository]]:
    """The whole table in the shape `kernels.use_kernel_mapping` takes (every device type of
    every layer). The worker registers only `resolved_mapping(select(...))`; this is for
    checking the table against `kernels`' own resolution."""
    return _declare(_ENTRIES)


def _interval(device: Device) -> tuple[int, int]:
    props = device.properties
    return (0, _ANY) if props is None else (props.min_capability, props.max_capability)


def _checked(device_type: str, capability) -> Capability | None:
    """The device's capability (None for CPU); a GPU without one is an error."""
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"Unsupported device type `{device_type}`. Supported: {', '.join(DEVICE_TYPES)}")
    if device_type == "cpu":
        return None
    try:
        return Capability.parse(capability)
    except CapabilityError:
        raise ValueError(
            f"A `{device_type}` device needs a capability (major, minor), got `{capability}`. "
            f"Accepted: {ACCEPTED_CAPABILITY_SPELLINGS}"
        ) from None


def _describe(device_type: str, capability: Capability | None) -> str:
    if capability is None:
        return "cpu"
    return capability.sm if device_type == "cuda" else f"ROCm capability {capability.label}"


def _resolve(layer: str, device_type: str, cap: int | None) -> _Entry:
    candidates = []
    for e in _ENTRIES:
        if e.layer != layer or e.device.type != device_type:
            continue
        lo, hi = _interval(e.device)
        if cap is None or lo <= cap <= hi:
            candidates.append((hi - lo, e))
    if not candidates:  # the table covers every capability; a test walks them all
        raise LookupError(f"No kernel mapping entry for `{layer}` on `{device_type}` capability `{cap}`")
    return min(candidates, key=lambda c: c[0])[1]  # the smallest interval wins, as in `kernels`


def select(device_type: str, capability) -> dict[str, KernelChoice]:
    """The kernel for each layer on one device. Pure: depends only on its arguments.
    `capability` is (major, minor); 90, "9.0" and "sm_90" are accepted too.

    Every capability resolves: the CUDA entries without properties catch what no range covers
    (below sm_70; below sm_80 for the fused MoE's grouped GEMM), and the last ranges are open-ended
    so architectures newer than the tuned ones (sm_100, sm_120) get a defined, forward-compatible
    choice whose reason says so."""
    capability = _checked(device_type, capability)
    cap = None if capability is None else capability.int
    where = _describe(device_type, capability)
    choices = {}
    for layer in LAYERS:
        e = _resolve(layer, device_type, cap)
        reason = e.why if device_type == "cpu" else f"{where}: {e.why}"
        choices[layer] = KernelChoice(
            repo=f"kernels_local/{e.repo}", layer=e.layer_class, variant=e.variant, reason=reason, fp8=e.fp8
        )
    return choices


def resolved_mapping(
    choices: dict[str, KernelChoice], device_type: str
) -> dict[str, dict[Device, LocalLayerRepository]]:
    """A mapping holding only these choices, registered for `device_type` (no capability
    ranges left for `kernels` to resolve on its own)."""
    return {layer: {Device(type=device_type): c.repository()} for layer, c in choices.items()}
