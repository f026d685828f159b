"""What a kernel repository declares so that its Triton kernels can be compiled ahead of time.

Next to each kernel, its repository writes a function listing every launch the kernel's wrapper
can make for a `Workload` (the model's dtype, row widths and head dims, tokens per launch, the fp8
flavour) as `CompileSpec`s, computed from the same tuning method as the wrapper's launch, so the
two cannot drift apart. Each repository's `layers` maps its Triton layer classes to such
functions (`COMPILE_SPECS`); the preflight (`workers.kernelize.preflight`) compiles whatever the
selected layers declare, so a new kernel is preflighted by declaring its specs, not by editing
the preflight. The trade-off: widths that are not multiples of 16 compile a variant with narrower
loads that the preflight covers only when the worker's own model has them (`int_arg`). This
module imports neither torch nor triton, and no repository depends on more than it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Row widths of realistic models (hidden, intermediate and attention sizes from 256 to 16384):
# every launch shape the tunings choose depends only on the next power of two of a width.
REALISTIC_WIDTHS = tuple(2**k for k in range(8, 15))
# Head dims of realistic models (64: Llama 3.2 1B; 128: most; 256: Gemma; 512: Gemma 4's global
# layers); 80 and 96 pad to 128. Attention kernels launch per head rather than per row, so their
# launches depend on the head dim, again only through its next power of two.
REALISTIC_HEAD_DIMS = (64, 128, 256, 512)
# Tokens one launch can carry (a long prefill); every smaller count is a power of two below it.
MAX_TOKENS = 8192
DTYPES = ("bf16", "fp16", "fp32")
FP8_TYPES = {"e4m3fn": "fp8e4nv", "e4m3fnuz": "fp8e4b8"}  # Triton's names of the e4m3 flavours


@dataclass(frozen=True)
class Workload:
    """What the kernels will be launched on: activation dtype, row widths, tokens per launch,
    the e4m3 flavour of the device's fp8 convention, and attention head dims."""

    dtype: str = "bf16"  # Triton's name of the model dtype: "bf16" | "fp16" | "fp32"
    widths: tuple[int, ...] = REALISTIC_WIDTHS
    max_tokens: int = MAX_TOKENS
    fp8_fmt: str = "e4m3fn"  # "e4m3fn" (OCP) | "e4m3fnuz" (AMD CDNA3)
    head_dims: tuple[int, ...] = REALISTIC_HEAD_DIMS

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"Unsupported workload dtype `{self.dtype}`. Supported: {', '.join(DTYPES)}")
        if self.fp8_fmt not in FP8_TYPES:
            raise ValueError(f"Unknown e4m3 format `{self.fp8_fmt}`. Supported: {', '.join(FP8_TYPES)}")
        if not self.widths or min(self.widths) < 1 or self.max_tokens < 1:
            raise ValueError(f"A workload needs positive widths and tokens, got `{self.widths}`, `{self.max_tokens}`")
        if not self.head_dims or min(self.head_dims) < 1:
            raise ValueError(f"A workload needs positive head dims, got `{self.head_dims}`")
        object.__setattr__(self, "widths", tuple(sorted(set(self.widths))))
        object.__setattr__(self, "head_dims", tuple(sorted(set(self.head_dims))))

    @property
    def fp8_type(self) -> str:
        """Triton's element type of fp8 operands in this flavour (`fp8e4nv` or `fp8e4b8`)."""
        return FP8_TYPES[self.fp8_fmt]

    def token_counts(self) -> tuple[int, ...]:
        """1, 2, 4 ... up to `max_tokens`: one token count per launch shape a tuning can pick."""
        counts, m = [], 1
        while m < self.max_tokens:
            counts.append(m)
            m *= 2
        return (*counts, self.max_tokens)


def int_arg(value: int) -> str:
    """Triton's type of an integer argument with this value: divisible by 16 or not.

    The marks mirror what Triton's JIT specializes at run time: tensors from torch's allocator are
    16-byte aligned and the model's widths are multiples of 16, and that specialization is the one
    that vectorizes and pipelines (the most shared memory). An integer equal to 1 (a batch of one)
    gets its own specialization at run time too; it only drops masks."""
    return "i32:16" if value % 16 == 0 else "i32"


def pointer(dtype: str) -> str:
    """A tensor argument of element type `dtype` (16-byte aligned, as torch allocates)."""
    return f"*{dtype}:16"


@dataclass(frozen=True)
class CompileSpec:
    """One launch of one Triton kernel: what `triton.compile` needs to build it ahead of time."""

    kernel: Any = field(compare=False)  # the @triton.jit function (not compared: its name is)
    # (name, type) of the runtime arguments, in kernel order, in the notation of Triton's own
    # ahead-of-time compiler: "*bf16:16" a pointer to bf16 aligned to 16 bytes, "i32:16" an integer
    # divisible by 16, "i32" any integer
    args: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int = 3  # Triton's default; only loops with loads are pipelined
    dot: str | None = None  # operand type of the tensor-core dot ("fp8", "f16"), None without one
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", getattr(self.kernel, "__name__", str(self.kernel)))

    @property
    def config(self) -> str:
        """`BLOCK_M=16 BLOCK_N=64 ... warps=4 stages=3`: the launch configuration in one line."""
        shown = " ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{shown} warps={self.num_warps} stages={self.num_stages}".strip()


def unique(specs) -> tuple[CompileSpec, ...]:
    """Specs in first-seen order without repeats (several widths often share one launch)."""
    return tuple(dict.fromkeys(specs))
