"""Kernelize the worker's model for its own bound device, with exactly `select()`'s choices.

Design: the choice is `kernels_local.mapping.select(bound.type, bound.capability)`, a pure
function of the bound device, and `kernels` applies a mapping holding only those choices
(`inherit_mapping=False`), so it has nothing left to decide. On a real GPU it kernelizes for the
GPU's device type, after `crosscheck` found `kernels`' own capability equal to the bound one; a
simulated device or a CPU registers the chosen layers for "cpu", so they run through their CPU
path (a Triton layer falls back to its torch reference). Every swappable module is then checked
to run the chosen forward, and the plan is recorded on the model (`model.kernel_plan`), so layers
created later (`--quantize fp8`'s `Fp8Linear`) get the same choice without their package
importing this one. Trade-off: the mapping is resolved once per process; a worker never
re-selects."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

from kernels import KernelizeFallback, Mode, kernelize, use_kernel_mapping
from torch import nn

from kernels_local.mapping import KernelChoice, resolved_mapping, select
from workers.device.bind import BoundDevice
from workers.kernelize.crosscheck import refuse_on_mismatch

logger = logging.getLogger(__name__)


class KernelizeError(RuntimeError):
    """A swappable layer did not end up running the kernel chosen for this device."""


@dataclass(frozen=True)
class KernelPlan:
    """What a model was kernelized with: the `kernels` device type and one choice per layer."""

    device_type: str  # "cuda" | "rocm" on a real GPU; "cpu" when compute runs on the CPU
    choices: dict[str, KernelChoice]

    def apply(self, module: nn.Module) -> int:
        """Kernelize `module`, a layer created after this plan was made, with it (`apply_plan`)."""
        return apply_plan(module, self)


def kernel_device_type(bound: BoundDevice) -> str:
    """The device type `kernels` kernelizes for: the GPU's own, or "cpu" for simulated devices."""
    return bound.type if bound.is_real_gpu else "cpu"


def kernelize_for_device(model: nn.Module, bound: BoundDevice) -> dict[str, KernelChoice]:
    """Swap the model's kernel layers for those chosen for `bound`; returns the choices."""
    # 1. the selection: a pure function of the bound device
    choices = select(bound.type, bound.capability)
    # 2. on a real GPU, `kernels` must compute the same capability as the bound device
    if bound.is_real_gpu:
        logger.info("capability cross-check: %s", refuse_on_mismatch(bound))
    # 3. apply exactly that selection, then record it for layers created later
    plan = KernelPlan(kernel_device_type(bound), choices)
    apply_plan(model, plan)
    model.kernel_plan = plan
    for layer, c in choices.items():
        logger.info("kernel %s -> %s:%s (%s): %s", layer, c.repo, c.layer, c.variant, c.reason)
    return choices


def apply_plan(module: nn.Module, plan: KernelPlan) -> int:
    """Kernelize `module` (and its children) with `plan`; returns how many layers were swapped."""
    mapping = resolved_mapping(plan.choices, plan.device_type)
    with use_kernel_mapping(mapping, inherit_mapping=False), _quiet_root_info():
        # layers we do not map keep their forward; a mapped one that cannot load raises
        kernelize(
            module, device=plan.device_type, mode=Mode.INFERENCE, use_fallback=KernelizeFallback.NO_LAYER
        )
    return _verify(module, plan)


@contextlib.contextmanager
def _quiet_root_info():
    """`kernels` logs one INFO line per swapped module on the root logger; the worker logs
    the choice once per layer instead, so those lines are held back while kernelizing."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        root.setLevel(level)


def _verify(module: nn.Module, plan: KernelPlan) -> int:
    """Every swappable module of a planned layer runs the chosen layer's forward."""
    expected = {}
    swapped = 0
    for name, m in module.named_modules():
        layer = getattr(type(m), "kernel_layer_name", None)
        if layer not in plan.choices:
            continue
        if layer not in expected:
            expected[layer] = plan.choices[layer].repository().load()
        forward = getattr(m.forward, "__func__", None)
        if forward is not expected[layer].forward:
            c = plan.choices[layer]
            raise KernelizeError(
                f"Module `{name or type(m).__name__}` ({layer}) does not run the chosen kernel "
                f"`{c.repo}:{c.layer}` ({c.variant}) after kernelize"
            )
        swapped += 1
    return swapped
