"""KV blocks between workers whose KV dtypes differ: converted only where the result is exact.

On a mixed host the worker that computed a prompt's KV and the one that continues it may keep KV
in different dtypes (bf16 on an sm_86, fp16 on an sm_75, fp8 where a worker chose it). Design: a
block converts by casting and proving the cast exact, i.e. casting the result back gives the
same bits (a NaN stays a NaN). bf16 -> fp16 is exact for every value within fp16's normal range
(bf16's 8 significant bits fit in fp16's 11); a value beyond 65504 or below fp16's normal range
is not, and then the whole block is refused with the reason (how many values, the largest
magnitude), so the caller recomputes the prompt rather than decode from rounded KV. The other
directions (fp16 -> bf16, anything -> fp8) are exact only for values that happen to fit, and go
through the same proof. Trade-off: the proof costs a second cast and a compare of the block,
small beside moving it, and it never converts "nearly"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Pairs whose cast is exact for every value in a known range: the range and why.
EXACT_WITHIN = {
    (torch.bfloat16, torch.float16): "bf16 -> fp16 is exact within fp16's normal range (|x| in [2^-14, 65504] or 0)",
    (torch.float16, torch.float32): "fp16 -> fp32 is always exact",
    (torch.bfloat16, torch.float32): "bf16 -> fp32 is always exact",
}


@dataclass(frozen=True)
class Conversion:
    """A block in the target dtype, or None and why it could not be converted exactly."""

    block: torch.Tensor | None
    reason: str

    @property
    def exact(self) -> bool:
        return self.block is not None


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal values, or both NaN."""
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def exact_cast(block: torch.Tensor, dtype: torch.dtype) -> Conversion:
    """`block` as `dtype` when every value survives the cast unchanged; else no block and the
    reason (the count of values that would change and the largest magnitude among them)."""
    if block.dtype == dtype:
        return Conversion(block, "same dtype")
    cast = block.to(dtype)
    back = cast.to(block.dtype)
    changed = ~_same(back, block)
    if not bool(changed.any()):
        why = EXACT_WITHIN.get((block.dtype, dtype), f"{block.dtype} -> {dtype}: every value of this block fits")
        return Conversion(cast, why)
    bad = block[changed].float().abs()
    finfo = torch.finfo(dtype)
    return Conversion(None, f"{int(changed.sum())} of {block.numel()} values of this block change in "
                            f"{block.dtype} -> {dtype} (largest {float(bad.max()):.6g}, smallest "
                            f"{float(bad.min()):.6g}; {dtype} holds |x| in [{finfo.smallest_normal:.3g}, "
                            f"{finfo.max:.6g}] with {finfo.bits - 1 - _exponent_bits(dtype)} fraction bits)")


def _exponent_bits(dtype: torch.dtype) -> int:
    return {torch.float32: 8, torch.bfloat16: 8, torch.float16: 5, torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}.get(
        dtype, 8)
