"""The compute dtype a device loads a checkpoint in (`--dtype auto`), as names, without torch.

Design: the rule is a pure function of (requested dtype, the checkpoint's dtype, the compute
device's type, its capability) returning the dtype's name and the reason, so the router's
placement sizes a model's weights on each device with the same answer the worker's loader
(`choose_dtype()`) arrives at. On a CPU, bfloat16 is computed well only where oneDNN has
bfloat16 kernels (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX); an AVX2-only CPU emulates it several
times slower (docs/benchmarks.md, "CPU projections"), so there `auto` computes a bfloat16
checkpoint in float32 (`cpu_bfloat16()` reads /proc/cpuinfo; where it cannot tell, bfloat16).
Trade-off: names, not torch dtypes, so that the contract stays torch-free; `DTYPE_BYTES` is the
one table of element sizes both sides use."""

from __future__ import annotations

import functools

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_CHOICES = ("auto", *DTYPE_BYTES)
# safetensors' dtype names -> bytes per element (the header's `dtype` field)
SAFETENSORS_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
SAFETENSORS_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})  # loaded in the compute dtype


class DtypeError(ValueError):
    """A `--dtype` that is not one of `DTYPE_CHOICES`."""


# oneDNN's bfloat16 kernels need one of these (Linux's /proc/cpuinfo flag names)
BF16_FLAG_SETS = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}),
                  frozenset({"amx_bf16"}))


def bfloat16_flags(flags: frozenset[str]) -> str | None:
    """What in `flags` computes bfloat16 (e.g. `avx512bw avx512dq avx512vl`), or None."""
    found = next((have for have in BF16_FLAG_SETS if have <= flags), None)
    return None if found is None else " ".join(sorted(found))


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """This host's CPU feature flags (Linux's /proc/cpuinfo names), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), None)
    except OSError:
        return None
    return None if line is None else frozenset(line.split(":", 1)[-1].split())


def cpu_bfloat16() -> bool:
    """Whether this host's CPU computes bfloat16 matmuls natively (module docstring); True where
    its flags cannot be read (not Linux, not x86)."""
    flags = cpu_flags()
    return flags is None or bfloat16_flags(flags) is not None


def dtype_rule(requested: str, checkpoint_dtype: str | None, device_type: str,
               capability: tuple[int, int] | None = None, cpu_bf16: bool | None = None) -> tuple[str, str]:
    """(dtype name, reason). `auto` keeps the checkpoint's dtype where the device computes it well
    (`cpu_bf16`: whether the CPU computes bfloat16; None: this host's, `cpu_bfloat16()`)."""
    if requested not in DTYPE_CHOICES:
        raise DtypeError(f"Unsupported dtype `{requested}`. Supported: {', '.join(DTYPE_CHOICES)}")
    if requested != "auto":
        return requested, f"requested {requested}"
    saved = checkpoint_dtype if checkpoint_dtype in DTYPE_BYTES else None
    if device_type == "cpu":
        if saved == "bfloat16" and not (cpu_bfloat16() if cpu_bf16 is None else cpu_bf16):
            return "float32", ("auto: checkpoint is bfloat16, but this CPU has no AVX-512, AVX-NE-CONVERT or AMX: "
                               "its bfloat16 matmuls would be emulated (2-9x float32's time), so float32")
        if saved in ("bfloat16", "float32"):
            return saved, f"auto: checkpoint is {saved}, which CPU matmuls support natively"
        if saved == "float16":
            return "float32", ("auto: checkpoint is float16; CPU float16 matmuls are slow and bfloat16 would "
                               "round its weights, so float32")
        return "float32", "auto: checkpoint dtype unknown; float32 on CPU"
    bf16_ok = capability is None or tuple(capability) >= (8, 0)
    if saved in ("bfloat16", "float16") and (saved == "float16" or bf16_ok):
        return saved, f"auto: checkpoint is {saved}"
    if bf16_ok:
        return "bfloat16", f"auto: checkpoint is {saved or 'unspecified'}; bfloat16 on a GPU with native bf16"
    return "float16", f"auto: checkpoint is {saved or 'unspecified'}; float16 (no native bf16 below sm_80)"
