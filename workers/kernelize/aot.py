"""Compile one declared kernel launch for one GPU target, ahead of time, and read its figures.

Design: `compile_spec(spec, target)` turns a repository's `CompileSpec` into what `triton.compile`
takes (the signature, the constexprs and the alignment attributes Triton's JIT would specialize
on) and compiles it for a named `GPUTarget`, without a GPU (`ptxas` ships in the triton wheel,
ROCm code objects come from Triton's LLVM). From the result it reads what the hardware limits
are about: shared memory, registers and spills per thread (`cuobjdump` on the cubin, the code
object's metadata on ROCm) and the first tensor-core instruction. A compiler error is a result,
not an exception: its message is what the preflight records. Compiles go through Triton's
per-architecture on-disk cache. Trade-off: compiles run one after another in the calling process
(Triton's compiler is not documented as thread-safe); callers needing several targets at once
use one process each."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from kernels_local.compile_spec import CompileSpec
from workers.contract import Capability

# Tensor-core instructions, operands stripped: PTX mma / wgmma / tcgen05, AMD MFMA.
_TENSOR_CORE = re.compile(r"\b((?:wgmma\.mma_async|tcgen05\.mma|mma\.sync)[\w.:]*|v_mfma_\w+)")
_CUOBJDUMP_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:\d+\s+LOCAL:(\d+)")
_AMD_FIELDS = ("vgpr_count", "agpr_count", "private_segment_fixed_size")


@dataclass(frozen=True)
class Target:
    """A compiler target: backend ("cuda" | "hip"), architecture and warp size."""

    backend: str
    arch: str  # our name: "sm_90", "gfx942"
    warp_size: int

    @classmethod
    def for_device(cls, device_type: str, capability, arch: str | None = None) -> Target | None:
        """The target of a device description; None for a CPU (nothing to compile)."""
        if device_type == "cuda":
            return cls("cuda", Capability.parse(capability).sm, 32)
        if device_type == "rocm":
            if not arch:
                raise ValueError(f"A ROCm device needs its gfx arch to compile for, got `{arch}`")
            return cls("hip", arch.split(":")[0], 64)
        return None

    @classmethod
    def current(cls) -> Target:
        """The target of the GPU this process drives (Triton's driver asks the device)."""
        from triton.runtime import driver

        t = driver.active.get_current_target()
        arch = Capability.parse(t.arch).sm if t.backend == "cuda" else str(t.arch)
        return cls(t.backend, arch, t.warp_size)

    @property
    def triton(self):
        from triton.backends.compiler import GPUTarget

        arch = Capability.parse(self.arch).int if self.backend == "cuda" else self.arch
        return GPUTarget(self.backend, arch, self.warp_size)

    @property
    def name(self) -> str:
        """What the code is generated for: `sm_90a` (Triton's arch-specific sm_90+), `gfx942`."""
        if self.backend != "cuda":
            return self.arch
        cap = Capability.parse(self.arch)
        return f"{cap.sm}a" if cap.int >= 90 else cap.sm


@dataclass(frozen=True)
class Compiled:
    """The outcome of one compile: ok, or the compiler's message; figures when it compiled."""

    ok: bool
    error: str | None = None
    shared_bytes: int | None = None
    registers: int | None = None  # per thread (VGPRs + AGPRs per lane on ROCm)
    spill_bytes: int | None = None  # per thread: the stack frame / private segment spills go to
    instruction: str | None = None  # first tensor-core instruction of the generated code


def compile_spec(spec: CompileSpec, target: Target) -> Compiled:
    """Compile `spec` for `target`; a compiler failure comes back as `Compiled(ok=False, error)`."""
    import triton
    from triton.compiler import ASTSource, make_backend

    names = list(spec.kernel.arg_names)
    kinds = {name: kind.split(":")[0] for name, kind in spec.args} | {name: "constexpr" for name, _ in spec.constexprs}
    if set(kinds) != set(names):
        raise ValueError(f"Compile spec of `{spec.name}` declares arguments `{sorted(kinds)}`; the kernel takes "
                         f"`{names}`")  # fmt: skip
    signature = {name: kinds[name] for name in names}  # in the kernel's parameter order
    backend = make_backend(target.triton)
    attrs = {}
    for name, kind in spec.args:
        desc = _specialization(kind, target)
        if desc:
            attrs[(names.index(name),)] = backend.parse_attr(desc)
    source = ASTSource(spec.kernel, signature, dict(spec.constexprs), attrs)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages}
    try:
        # Triton prints a failing ptxas run's source to stdout; keep stdout for our own output.
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
            kernel = triton.compile(source, target=target.triton, options=options)
    except Exception as e:  # the compiler's own verdict is the result
        return Compiled(ok=False, error=_message(e))
    registers, spills = _resources(kernel.asm, target)
    code = kernel.asm.get("ptx") or kernel.asm.get("amdgcn") or ""
    found = _TENSOR_CORE.search(code)
    return Compiled(True, None, int(kernel.metadata.shared), registers, spills, found.group(1) if found else None)


def _specialization(kind: str, target: Target) -> str:
    """Triton's specialization letters for an argument: D (divisible by 16) for the `:16`
    marks, plus S (pointer within 2 GiB, buffer loads) for ROCm tensors, as its JIT gives."""
    if not kind.endswith(":16"):
        return ""
    if kind.startswith("*") and target.backend == "hip":
        from triton import knobs

        return "DS" if knobs.amd.use_buffer_ops else "D"
    return "D"


def _message(e: Exception) -> str:
    """The compiler's verdict in one line: the last line of a Triton error (the cause after
    the source excerpt), or the first lines of a ptxas failure."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    line = lines[-1] if type(e).__name__ == "CompilationError" else " ".join(lines[:3])
    inner = re.fullmatch(r"\w+(?:Error|Exception)\(['\"](.*)['\"]\)", line)
    return (inner.group(1) if inner else line)[:400]


def _resources(asm: dict, target: Target) -> tuple[int | None, int | None]:
    """(registers per thread, spilled bytes per thread) from the binary, if readable."""
    if target.backend == "cuda" and "cubin" in asm:
        return _cubin_resources(asm["cubin"])
    if "amdgcn" in asm:
        fields = {}
        for name in _AMD_FIELDS:
            m = re.search(rf"^\s*\.{name}:\s+(\d+)", asm["amdgcn"], re.M)
            fields[name] = int(m.group(1)) if m else 0
        return fields["vgpr_count"] + fields["agpr_count"], fields["private_segment_fixed_size"]
    return None, None


def _cubin_resources(cubin: bytes) -> tuple[int | None, int | None]:
    from triton import knobs

    tool = knobs.nvidia.cuobjdump
    if tool is None:
        return None, None
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([tool.path, "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             timeout=60).stdout  # fmt: skip
    m = _CUOBJDUMP_USAGE.search(out)
    if m is None:
        return None, None
    return int(m.group(1)), int(m.group(2)) + int(m.group(3))
