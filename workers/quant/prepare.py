"""The fp8 step for a pre-quantized checkpoint: every fp8 layer turned into this device's execution.

Design: `prepare_fp8_checkpoint` asks the contract's `fp8_execution` (the rule that also gives the
device its fp8 convention and the kernel mapping its ranges) how this device runs fp8 checkpoints,
checks that the locked convention and the kernels chosen for `Fp8CheckpointLinear` and
`Fp8FusedMoE` are of that execution (`Fp8ExecutionMismatchError` otherwise), prepares each layer
and returns what `/workers` shows under `fp8.checkpoint` (the execution, its reason, the weights'
bytes and what widening costs, also logged as a warning). Trade-off: a dequantizing device
releases the fp8 bytes and holds the widened weights only, as an unquantized checkpoint would."""

from __future__ import annotations

import logging

from torch import nn

from workers.contract import FP8_DEQUANTIZED, FP8_NATIVE, fp8_execution
from workers.quant.experts import Fp8FusedMoE
from workers.quant.linear import Fp8CheckpointLinear

logger = logging.getLogger(__name__)

LAYER = "Fp8CheckpointLinear"
EXPERTS = "Fp8FusedMoE"


class Fp8ExecutionMismatchError(RuntimeError):
    """The fp8 convention or the kernel chosen for this device is of another execution than its rule says."""


def _check(execution, convention, plan) -> None:
    native = execution.kind == FP8_NATIVE
    if convention is not None and (convention.native != native or convention.fmt != execution.fmt):
        raise Fp8ExecutionMismatchError(
            f"The worker's fp8 convention `{convention.name}` ({convention.fmt}) does not fit the checkpoint "
            f"execution `{execution.kind}` ({execution.fmt}); both must come from the same device decision")
    for layer in (LAYER, EXPERTS):
        choice = None if plan is None else plan.choices.get(layer)
        if choice is not None and choice.fp8 != execution.kind:
            raise Fp8ExecutionMismatchError(
                f"The `{layer}` kernel chosen for this device (`{choice.variant}`) runs the execution `{choice.fp8}`, "
                f"not `{execution.kind}`; both must come from the same device decision")


def prepare_fp8_checkpoint(model: nn.Module, convention, device_type: str, capability) -> dict:
    """Prepare every `Fp8CheckpointLinear` of `model` for this device; the summary for `/workers`."""
    execution = fp8_execution(device_type, capability)
    # 1. the locked convention and the chosen kernel agree with the execution
    plan = getattr(model, "kernel_plan", None)
    _check(execution, convention, plan)
    # 2. each layer in the device's execution, bytes before and after
    layers = [m for m in model.modules() if isinstance(m, (Fp8CheckpointLinear, Fp8FusedMoE))]
    if not layers:  # a 4-bit checkpoint: no fp8 execution to claim (its own facts: `quantization`)
        return {"execution": None, "fmt": None, "reason": "no fp8 layers in this checkpoint", "layers": 0,
                "expert_layers": 0, "stored_bytes": 0, "weight_bytes": 0, "widened_bytes": 0, "kernel": None,
                "expert_kernel": None, "kept": []}
    stored = sum(m.nbytes() for m in layers)
    for m in layers:
        m.prepare(execution.kind, execution.fmt)
    now = sum(m.nbytes() for m in layers)
    choice = None if plan is None else plan.choices.get(LAYER)
    experts = sum(isinstance(m, Fp8FusedMoE) for m in layers)
    expert_choice = None if plan is None or not experts else plan.choices.get(EXPERTS)
    summary = {"execution": execution.kind, "fmt": execution.fmt, "reason": execution.reason,
               "layers": len(layers) - experts, "expert_layers": experts,
               "stored_bytes": stored, "weight_bytes": now, "widened_bytes": max(0, now - stored),
               "kernel": None if choice is None else choice.to_dict(),
               "expert_kernel": None if expert_choice is None else expert_choice.to_dict(),
               "kept": [n for n, m in model.named_modules() if type(m) is nn.Linear]}
    # 3. said once: a device that widens the weights says how much it costs
    if execution.kind == FP8_DEQUANTIZED and layers:
        logger.warning("fp8 checkpoint widened to %s on this device: %d layers, %d -> %d bytes (%s)",
                       layers[0].compute_dtype, len(layers), stored, now, execution.reason)
    else:
        logger.info("fp8 checkpoint runs %s (%s bytes): %d layers, %d bytes: %s", execution.kind, execution.fmt,
                    len(layers), now, execution.reason)
    return summary
