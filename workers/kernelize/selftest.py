"""Start-up self-test: the kernelized (and quantized) model against the same model's torch
reference path, on the same device, before the worker reports ready.

Design: kernelize swaps a module's forward on the instance and the class keeps its pure-torch
forward, the reference; `reference_path(model)` takes the instance forwards off for one call, so
the same weights, device and input run once through the kernels and once through torch. Two
passes run on each path: a full causal forward of `BATCH` x `TOKENS` fixed tokens, and one engine
step decoding each row's last token over a small, scattered paged KV cache (the decode attention
kernel the full forward does not use). The figure is the largest logit difference relative to the
largest reference logit: a wrong kernel moves it by orders of magnitude, rounding by a fraction
(`TOLERANCE` allows for the kernels' summation order over a reduced-precision model's layers).
Trade-off: milliseconds on a GPU prove every swapped layer end to end, but not every launch shape,
which the preflight covers at compile level."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

BATCH, TOKENS, SEED = 2, 16, 1234
KV_BLOCK = 4  # positions per block of the self-test's KV cache: each row spans several blocks
# Largest |kernel - reference| / max |reference| accepted on the logits, per model dtype.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 5e-2}


class SelfTestError(RuntimeError):
    """The kernelized model's forward disagrees with its torch reference path."""


@dataclass(frozen=True)
class SelfTestResult:
    max_abs_error: float
    reference_scale: float  # max |reference logit|
    relative_error: float
    tolerance: float
    swapped: int  # modules whose kernel forward was compared
    shape: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return self.relative_error <= self.tolerance

    def __str__(self) -> str:
        return (f"logits {list(self.shape)} of {self.swapped} kernel modules: max |kernel - reference| = "
                f"{self.max_abs_error:.4g}, {self.relative_error:.3%} of max |logit| {self.reference_scale:.4g} "
                f"(tolerance {self.tolerance:.1%})")  # fmt: skip


@contextlib.contextmanager
def reference_path(model: nn.Module) -> Iterator[int]:
    """Run the model's own (torch) forwards inside; yields how many kernel forwards it took off."""
    swapped = {}
    for m in model.modules():
        if "forward" in m.__dict__ and getattr(type(m), "kernel_layer_name", None):
            swapped[m] = m.__dict__.pop("forward")
    try:
        yield len(swapped)
    finally:
        for m, forward in swapped.items():
            m.forward = forward


def fixed_input(vocab_size: int, device) -> torch.Tensor:
    """The same [BATCH, TOKENS] token ids on every run and every device."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, vocab_size, (BATCH, TOKENS), generator=g).to(device)


def decode_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] of one paged decode step: each row's first S - 1 tokens prefilled into a
    fresh pool, then its last token decoded; row i holds blocks i, i + B, i + 2B, ... (no row
    is a contiguous run, so attention reads them through the block table)."""
    from workers.kv.batch import ForwardBatch, SeqChunk

    batch, tokens = ids.shape
    per_row = -(-tokens // KV_BLOCK)
    kv = model.new_kv_pool(batch * per_row, KV_BLOCK)
    tables = [list(range(i, batch * per_row, batch)) for i in range(batch)]
    rows = ids.tolist()
    prefill = [(SeqChunk(0, tokens - 1, t, num_logits=0), r[:-1]) for t, r in zip(tables, rows, strict=True)]
    model.step(ForwardBatch.build(prefill, KV_BLOCK, ids.device, windows=kv.windows), kv)
    decode = [(SeqChunk(tokens - 1, 1, t), r[-1:]) for t, r in zip(tables, rows, strict=True)]
    return model.step(ForwardBatch.build(decode, KV_BLOCK, ids.device, windows=kv.windows), kv)  # [B, V]


@torch.inference_mode()
def compare_with_reference(model: nn.Module, vocab_size: int, device) -> SelfTestResult:
    """The full forward and a paged decode step through the kernels, then through the torch
    reference path; the figures cover both."""
    ids = fixed_input(vocab_size, device)
    full = model(ids).float()  # [B, S, V]
    kernel = torch.cat((full.flatten(0, 1), decode_step(model, ids)))  # [B*S + B, V]
    with reference_path(model) as swapped:
        reference = torch.cat((model(ids).float().flatten(0, 1), decode_step(model, ids)))
    scale = reference.abs().max().item()
    err = (kernel - reference).abs().max().item()
    tol = TOLERANCE.get(next(model.parameters()).dtype, TOLERANCE[torch.bfloat16])
    rel = err / scale if scale > 0 else err
    if not torch.isfinite(kernel).all():
        rel = float("inf")
    return SelfTestResult(err, scale, rel, tol, swapped, tuple(full.shape))


def self_test(model: nn.Module, config, device) -> SelfTestResult:
    """`compare_with_reference`, raising `SelfTestError` with the figures on a mismatch."""
    result = compare_with_reference(model, config.vocab_size, device)
    if not result.ok:
        raise SelfTestError(f"kernelized forward disagrees with the torch reference: {result}")
    return result


@contextlib.contextmanager
def only_kernel(model: nn.Module, layer: str) -> Iterator[int]:
    """Inside, only the kernel forwards of layer `layer` run; every other kernelized module runs
    its torch forward. Yields how many modules keep their kernel."""
    swapped = {}
    for m in model.modules():
        name = getattr(type(m), "kernel_layer_name", None)
        if "forward" in m.__dict__ and name and name != layer:
            swapped[m] = m.__dict__.pop("forward")
    try:
        yield sum(1 for m in model.modules() if "forward" in m.__dict__
                  and getattr(type(m), "kernel_layer_name", None) == layer)
    finally:
        for m, forward in swapped.items():
            m.forward = forward


def to_torch_path(model: nn.Module, layer: str, why: str = "its kernel failed on this device") -> int:
    """Every module of layer `layer` runs its torch forward from now on; how many changed. A module
    whose torch path wants its weights otherwise (a GGUF layer's blocks, dequantized once: its
    `fall_back(why)`) is converted too."""
    changed = 0
    for m in model.modules():
        if getattr(type(m), "kernel_layer_name", None) != layer:
            continue
        if "forward" in m.__dict__:
            del m.__dict__["forward"]
            changed += 1
        if callable(getattr(m, "fall_back", None)):
            m.fall_back(why)
    return changed


def self_test_or_fall_back(model: nn.Module, config, device) -> tuple[SelfTestResult, dict[str, str]]:
    """The self-test, kernel by kernel where the whole model fails it: each layer whose kernel
    alone moves the logits past the tolerance (or makes them non-finite, or raises) goes back to
    its torch path for this worker, with the reason. Returns the final whole-model result and the
    layers sent back (layer -> why). `SelfTestError` only when the model still disagrees with its
    reference once every failing kernel is out: the torch path itself fails."""
    try:
        result = compare_with_reference(model, config.vocab_size, device)
        if result.ok:
            return result, {}
    except Exception as e:  # a kernel that raises on this device: find which, as for a wrong one
        logger.warning("self-test of the kernelized model raised (%s: %s); testing each kernel alone",
                       type(e).__name__, e)
    layers = sorted({type(m).kernel_layer_name for m in model.modules()
                     if "forward" in m.__dict__ and getattr(type(m), "kernel_layer_name", None)})
    failed: dict[str, str] = {}
    for layer in layers:
        try:
            with only_kernel(model, layer):
                alone = compare_with_reference(model, config.vocab_size, device)
            why = None if alone.ok else f"its self-test failed on this device: {alone}"
        except Exception as e:
            why = f"it raised in its self-test on this device ({type(e).__name__}: {str(e)[:200]})"
        if why is not None:
            to_torch_path(model, layer, why)
            failed[layer] = why
            logger.warning("kernel %s replaced by its torch path: %s", layer, why)
    result = compare_with_reference(model, config.vocab_size, device)
    if not result.ok:
        raise SelfTestError(f"the model disagrees with its torch reference even with the failing kernels "
                            f"({', '.join(failed) or 'none found'}) on their torch paths: {result}")
    return result, failed
