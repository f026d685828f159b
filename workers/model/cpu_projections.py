"""The CPU's projections: weights laid out once for a faster GEMM than torch's, rows padded to buckets.

On a CPU torch multiplies a float32 `nn.Linear` with MKL (its AVX2 path on this project's AMD
CPUs) and a bfloat16 one with oneDNN, which reorders the weight on every call. Design:
`install_cpu_projections` runs once on a CPU worker after loading and kernelizing (before
deterministic mode's row tiles, which then meet one shape) and lays every plain `nn.Linear` and
expert matrix of `MIN_PACKED_ELEMENTS` or more out once, on its dense tensor as `PACKED_ATTR`:
as column panels for oneDNN's brgemm where the panel GEMM builds and the reduction is at most
2048 (kernels_local/panel_linear/cpu.py, no per-call setup), else as a oneDNN pack. Projections
multiply through it (inside `torch.compile` the panels' C++ operator itself, a oneDNN pack through
`hetserve::packed_linear`), and the experts' kernels find the same layouts; a lone float32 row on
a pack and a prompt's `LARGE_ROWS` bfloat16 rows keep torch's matmul, faster there. float16, a
dtype this CPU's oneDNN cannot pack and packs over half the memory available are refused with the
reason (rows then only padded to buckets). Trade-off: the layouts are a second copy of the
weights beside the dense tensors, which the embedding and the reference paths read; what they
buy: docs/benchmarks.md, "CPU projections"."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels_local.panel_linear import cpu as cpu_gemm
from workers.model.row_buckets import EXACT_ROWS, row_bucket

PACKED_ATTR = cpu_gemm.PACKED_ATTR  # the attribute kernels_local/fused_moe/torch_path.py reads too


@functools.cache
def bf16_panels() -> bool:
    """Whether this CPU's brgemm multiplies bfloat16 panels: oneDNN's bfloat16 brgemm needs AMX
    (Intel from Sapphire Rapids); elsewhere (AVX2, AVX-512 without AMX) it refuses them, and
    bfloat16 weights take oneDNN's packs instead. Probed once on a [1, 2] x [2, 2] product."""
    if not cpu_gemm.load().available:
        return False
    w = torch.zeros(2, 2, dtype=torch.bfloat16)
    try:
        cpu_gemm.linear(torch.zeros(1, 2, dtype=torch.bfloat16), cpu_gemm.panels(w), None)
    except RuntimeError:
        return False
    return True


def panels_fit(weight: torch.Tensor) -> bool:
    """Whether `weight` is laid out as brgemm column panels here (its shape and dtype, and this CPU)."""
    return cpu_gemm.fits(weight) and (weight.dtype != torch.bfloat16 or bf16_panels())
PACKED_DTYPES = (torch.float32, torch.bfloat16)
MIN_PACKED_ELEMENTS = 1 << 16  # smaller matrices (a router) stay with torch's matmul: a call's setup outweighs the gain
AVAILABLE_SHARE = 0.5  # the packs may take at most this share of the memory available after loading
# From this many bfloat16 rows (a prompt's) oneDNN's matmul on the dense weight, reordered per call, is as
# fast as the column panels or faster (docs/benchmarks.md, "CPU projections"); its rows padded to a
# multiple of `LARGE_ROW_STEP` (a few dozen shapes up to a step's token budget).
LARGE_ROWS, LARGE_ROW_STEP = 512, 128


@dataclass(frozen=True)
class CpuProjections:
    """What `install_cpu_projections` did: layers changed, how many weights packed, the packs' bytes, why."""

    layers: int
    packed: int
    packed_bytes: int
    reason: str


def available_bytes() -> int | None:
    """The memory the kernel says is available (`MemAvailable`), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), EXACT_ROWS)


@functools.cache
def packing_refusal(dtype: torch.dtype) -> str | None:
    """Why this CPU's oneDNN cannot pack `dtype` weights (its own message), or None: one small
    matrix packed once per process, since which instruction sets oneDNN needs per dtype is its own
    business (bfloat16: AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    try:
        pack(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError as e:
        return str(e).strip().splitlines()[0]
    return None


def packed_linear_eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight.T + bias through the pack on `weight`: a oneDNN pack's rows padded to their
    bucket; column panels take the rows as they are (brgemm's kernels are per block of 64 rows, not
    per row count), except from `LARGE_ROWS` bfloat16 rows (a burst of prompts), which oneDNN's own
    matmul on the dense weight multiplies faster, rows padded to a multiple of `LARGE_ROW_STEP`."""
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)  # [R, K]
    n = rows.shape[0]
    packed = getattr(weight, PACKED_ATTR)
    if not cpu_gemm.is_panels(packed):
        out = torch.ops.mkldnn._linear_pointwise(_padded(rows, row_bucket(n)), packed, bias, "none", [], "")
    elif n >= LARGE_ROWS and rows.dtype == torch.bfloat16:
        out = F.linear(_padded(rows, -(-n // LARGE_ROW_STEP) * LARGE_ROW_STEP), weight, bias)  # [bucket, N]
    else:  # brgemm over the weight's column panels (kernels_local/panel_linear/cpu.py)
        out = cpu_gemm.linear(rows, packed, bias)  # [R, N]
    return out[:n].reshape(*lead, out.shape[-1])


def _padded(rows: torch.Tensor, bucket: int) -> torch.Tensor:
    """rows [R, K] with zero rows appended up to `bucket` (oneDNN compiles one kernel per row count)."""
    return rows if bucket == rows.shape[0] else F.pad(rows, (0, 0, 0, bucket - rows.shape[0]))


def _packed_linear_op():
    """`hetserve::packed_linear`, registered once per process: the compiled step's projection."""
    namespace = torch.ops.hetserve
    if hasattr(namespace, "packed_linear"):
        return namespace.packed_linear

    @torch.library.custom_op("hetserve::packed_linear", mutates_args=())
    def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return packed_linear_eager(x, weight, bias)

    packed_linear.register_fake(lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]))  # [..., N]
    return namespace.packed_linear


PACKED_LINEAR = _packed_linear_op()


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Through the weight's oneDNN pack, rows padded to their bucket (`hetserve::packed_linear` in a
    compiled step: the opaque pack stays out of the graph)."""
    if x.numel() == x.shape[-1] and x.dtype == torch.float32:  # a lone float32 row: MKL's GEMV beats the pack
        return F.linear(x, self.weight, self.bias)
    if torch.compiler.is_compiling():
        return PACKED_LINEAR(x, self.weight, self.bias)
    return packed_linear_eager(x, self.weight, self.bias)


def _panel_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Through the weight's column panels, every row count as it is (a lone float32 row too: the
    panels beat both the pack and MKL's GEMV); a compiled step calls the C++ operator itself, the
    panels read from the weight as the graph's input."""
    if torch.compiler.is_compiling():
        out = cpu_gemm.linear(x.reshape(-1, x.shape[-1]), getattr(self.weight, PACKED_ATTR), self.bias)  # [R, N]
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return packed_linear_eager(x, self.weight, self.bias)


def _bucketed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """float16: torch's own matmul, rows padded to their bucket (bounded oneDNN shapes)."""
    rows = x.shape[0]
    if x.dim() != 2 or rows <= EXACT_ROWS:
        return F.linear(x, self.weight, self.bias)
    padded = F.pad(x, (0, 0, 0, row_bucket(rows) - rows))  # [bucket, K]
    return F.linear(padded, self.weight, self.bias)[:rows]  # [rows, N]


def _expert_weights(model: nn.Module, min_elements: int) -> list[torch.Tensor]:
    """Every expert layer's stacked float weights (`w_gate_up` [E, 2I, H], `w_down` [E, H, I]) whose
    experts are large enough to pack (an expert's gate/up matrix of `min_elements` or more; both
    stacks, or neither)."""
    found = []
    for module in model.modules():
        pair = [getattr(module, name, None) for name in ("w_gate_up", "w_down")]
        if all(isinstance(w, torch.Tensor) and w.dim() == 3 and w.dtype in PACKED_DTYPES for w in pair) and \
                pair[0][0].numel() >= min_elements:  # fmt: skip
            found += pair
    return found


def _unpacked(linears: list[nn.Linear], reason: str) -> CpuProjections:
    """Every plain `nn.Linear` through torch's matmul, rows padded to buckets; nothing packed."""
    for module in linears:
        module.forward = types.MethodType(_bucketed_forward, module)
    return CpuProjections(len(linears), 0, 0, reason)


def install_cpu_projections(model: nn.Module, device, dtype: torch.dtype, min_elements: int = MIN_PACKED_ELEMENTS,
                            experts: bool = True) -> CpuProjections:  # fmt: skip
    """Pack the projections and (with `experts`) the experts of a CPU model in float32 / bfloat16
    (matrices of `min_elements` or more) and route every plain `nn.Linear` through its pack (the
    others: rows padded to buckets); float16: rows padded to buckets only; elsewhere nothing.
    Deterministic mode packs no experts: their packed loop does not take its fixed row tiles."""
    if torch.device(device).type != "cpu" or dtype not in (*PACKED_DTYPES, torch.float16):
        return CpuProjections(0, 0, 0, "not a CPU model in float32, bfloat16 or float16: torch's own matmuls")
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    if dtype == torch.float16:
        refusal = "oneDNN would emulate float16 on this CPU"
    else:
        refusal = packing_refusal(dtype) and f"this CPU's oneDNN: {packing_refusal(dtype)}"
    if refusal is not None:
        return _unpacked(linears, f"{str(dtype).removeprefix('torch.')}: rows padded to buckets, weights not "
                                  f"packed ({refusal})")  # fmt: skip
    weights = list({id(m.weight): m.weight for m in linears
                    if m.weight.dtype == dtype and m.weight.numel() >= min_elements}.values())  # fmt: skip
    experts = _expert_weights(model, min_elements) if experts else []
    total = sum(w.numel() * w.element_size() for w in (*weights, *experts))
    free = available_bytes()
    if free is not None and total > free * AVAILABLE_SHARE:
        return _unpacked(linears, f"not packed: the packs would take {total} bytes, over "
                                  f"{AVAILABLE_SHARE:.0%} of the {free} available")  # fmt: skip
    gemm = cpu_gemm.load()
    if experts:  # the experts' C++ loop builds now, at start, not on the first request (once per host)
        from kernels_local.fused_moe import cpu_experts

        cpu_experts.load()
    lay = (lambda w: cpu_gemm.panels(w) if panels_fit(w) else pack(w)) if gemm.available else pack
    with torch.no_grad():
        for w in weights:
            setattr(w, PACKED_ATTR, lay(w))
        for w in experts:
            setattr(w, PACKED_ATTR, tuple(lay(w[e]) for e in range(w.shape[0])))
    for module in linears:
        packed = getattr(module.weight, PACKED_ATTR, None)
        forward = _bucketed_forward if packed is None else _panel_forward if cpu_gemm.is_panels(packed) \
            else _packed_forward  # fmt: skip
        module.forward = types.MethodType(forward, module)
    panelled = sum(cpu_gemm.is_panels(p if isinstance(p, torch.Tensor) else p[0])
                   for p in (getattr(w, PACKED_ATTR) for w in (*weights, *experts)))  # fmt: skip
    return CpuProjections(len(linears), len(weights) + len(experts), total,
                          f"packed weights ({len(weights)} projections, {len(experts)} expert stacks, {total} bytes "
                          f"beside the dense ones; {panelled} as brgemm column panels, the others oneDNN packs: "
                          f"{gemm.reason}), rows padded to buckets")  # fmt: skip
