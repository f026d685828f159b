"""Preflight: every Triton kernel a device selects, compiled ahead of time for that device's
target and checked against its limits, before the device serves.

Design: `preflight(device_type, capability, arch, workload)` is pure given the device description:
it runs `kernels_local.mapping.select()` (the worker's own choice), takes each chosen layer's
launches from its repository (`COMPILE_SPECS`, declared next to the kernel), compiles each for the
device's target (`aot`) and checks it against the architecture's row (`arch_limits`; a real GPU's
own figures): a launch over the limits is refused naming the kernel, the figure and the limit,
and a dot records the instruction it compiled to. Where the fp8 rule says "emulated" it also
compiles the native fp8 kernel, whose compiler verdict is the recorded reason for emulation. One
function serves a real GPU's worker (before ready), `hetserve plan --compile` (a child per device:
`cli`) and CI (the whole matrix). Trade-off: a cold preflight costs seconds of compilation per
device; Triton's per-architecture cache makes later ones cheap. With `jobs` > 1 the layers are
compiled in that many spawned children (each re-selects its layer from the description, so no
kernel object crosses a process), for a lone preflight on an otherwise idle host; the report is
the same record for record."""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from kernels_local.compile_spec import CompileSpec, Workload
from kernels_local.mapping import KernelChoice, select
from workers.contract import NATIVE_FP8_CAPABILITY, PREFLIGHT_MODES, ROCM_NATIVE_FP8_CAPABILITY, fp8_rule
from workers.kernelize.aot import Compiled, Target, compile_spec
from workers.kernelize.arch_limits import ArchLimits, arch_limits
from workers.kernelize.records import KernelRecord, LayerPreflight, Preflight

logger = logging.getLogger(__name__)

FP8_LAYER = "Fp8Linear"


class PreflightError(RuntimeError):
    """A selected kernel does not compile for, or does not fit, the device it would run on."""


def preflight(device_type: str, capability, arch: str | None = None, workload: Workload | None = None, *,
              target: Target | None = None, limits: ArchLimits | None = None, jobs: int = 1,
              skip: Mapping[str, str] | None = None) -> Preflight:  # fmt: skip
    """Compile and check every Triton kernel `select()` picks for this device. Pure given the
    description; `target` and `limits` override the ones derived from it (a real GPU's); `jobs`:
    processes compiling layers at once; `skip`: layers the model never runs, each with why (noted,
    not compiled)."""
    # 1. the device's target, limits and the workload in its fp8 flavour
    decision = fp8_rule(device_type, capability)
    workload = replace(workload or Workload(), fp8_fmt=decision.fmt)
    target = target or Target.for_device(device_type, capability, arch)
    name = target.arch if target is not None else "cpu"
    if limits is None and target is not None:
        limits = arch_limits(target.arch)
    # 2. every chosen layer's launches, compiled and checked
    skip = skip or {}
    chosen = {layer: c for layer, c in select(device_type, capability).items() if layer not in skip}
    if jobs > 1 and target is not None:
        layers = _layers_in_children(device_type, capability, list(chosen), workload, target, limits, jobs)
    else:
        layers = {layer: _layer(layer, choice, workload, target, limits) for layer, choice in chosen.items()}
    for layer, c in select(device_type, capability).items():
        if layer in skip:
            layers[layer] = LayerPreflight(layer, c.variant, None if target is None else target.name,
                                           note=f"not compiled: {skip[layer]}")
    # 3. where fp8 is emulated on a GPU: the native kernel's verdict on this target
    native = None
    if target is not None and not decision.native:
        native = _native_fp8_proof(device_type, workload, target, limits)
    report = Preflight(name, None if target is None else target.name, limits, workload, layers, native)
    logger.info("preflight %s (%s): %s", name, report.target, "ok" if report.ok else "; ".join(report.refusals()))
    return report


def compile_specs_of(choice: KernelChoice):
    """The repository's compile-spec function for a chosen layer; None for a torch layer."""
    module = importlib.import_module(f"kernels_local.{Path(choice.repo).name}.layers")
    specs = getattr(module, "COMPILE_SPECS", {}).get(choice.layer)
    if specs is None and "triton" in choice.variant:
        raise PreflightError(
            f"`{choice.repo}:{choice.layer}` is a Triton layer ({choice.variant}) but its repository declares no "
            f"compile specs for it. Declared: {', '.join(sorted(getattr(module, 'COMPILE_SPECS', {}))) or 'none'}"
        )
    return specs


def _layer(layer: str, choice: KernelChoice, workload: Workload, target: Target | None,
           limits: ArchLimits | None) -> LayerPreflight:  # fmt: skip
    specs = compile_specs_of(choice)
    if target is None or specs is None:
        note = "CPU: nothing to compile" if target is None else f"{choice.variant}: torch, nothing to compile"
        return LayerPreflight(layer, choice.variant, None if target is None else target.name, note=note)
    records = tuple(check(spec, compile_spec(spec, target), target, limits) for spec in specs(workload))
    return LayerPreflight(layer, choice.variant, target.name, records)


def _layer_job(device_type: str, capability, layer: str, workload: Workload, target: Target,
               limits: ArchLimits | None) -> LayerPreflight:  # fmt: skip
    """One layer's preflight in a child: its choice selected again from the description."""
    return _layer(layer, select(device_type, capability)[layer], workload, target, limits)


def _layers_in_children(device_type: str, capability, layers: list[str], workload: Workload, target: Target,
                        limits: ArchLimits | None, jobs: int) -> dict[str, LayerPreflight]:  # fmt: skip
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=min(jobs, len(layers)), mp_context=multiprocessing.get_context("spawn")) as ex:
        futures = {layer: ex.submit(_layer_job, device_type, capability, layer, workload, target, limits)
                   for layer in layers}
        return {layer: f.result() for layer, f in futures.items()}


def _native_fp8_proof(device_type: str, workload: Workload, target: Target,
                      limits: ArchLimits | None) -> KernelRecord | None:  # fmt: skip
    """The first native fp8 dot of the layer the first native capability gets, on this target."""
    first_native = NATIVE_FP8_CAPABILITY if device_type == "cuda" else ROCM_NATIVE_FP8_CAPABILITY
    specs = compile_specs_of(select(device_type, first_native)[FP8_LAYER])
    dots = [s for s in (specs(workload) if specs else ()) if s.dot == "fp8"]
    return check(dots[0], compile_spec(dots[0], target), target, limits) if dots else None


def check(spec: CompileSpec, compiled: Compiled, target: Target, limits: ArchLimits | None) -> KernelRecord:
    """A compiled launch against the limits: the record, refused with its reason if it does not fit."""
    expected = None if limits is None or spec.dot is None else limits.expected_instruction(spec.dot)
    instruction_ok = None
    if compiled.ok and spec.dot is not None:
        instruction_ok = _matches(compiled.instruction, expected)
    refusal = compiled.error if not compiled.ok else _exceeds(spec, compiled, target, limits)
    return KernelRecord(
        kernel=spec.name, config=spec.config, target=target.name, num_warps=spec.num_warps,
        num_stages=spec.num_stages, ok=refusal is None, shared_bytes=compiled.shared_bytes,
        registers=compiled.registers, spill_bytes=compiled.spill_bytes, instruction=compiled.instruction,
        instruction_ok=instruction_ok, error=refusal,
    )  # fmt: skip


def _matches(instruction: str | None, expected: str | None) -> bool:
    if expected is None:  # no tensor cores for this operand type: none may be claimed either
        return True
    return instruction is not None and re.search(expected, instruction) is not None


def _exceeds(spec: CompileSpec, c: Compiled, target: Target, limits: ArchLimits | None) -> str | None:
    """Why a compiled launch does not fit (kernel, figure and limit named), or None."""
    if limits is None:
        return None
    what = f"`{spec.name}` ({spec.config}) on {target.name}"
    if c.shared_bytes is not None and c.shared_bytes > limits.shared_bytes:
        return f"{what} needs {c.shared_bytes} bytes of shared memory per block; the limit is {limits.shared_bytes}"
    if c.registers is not None and c.registers > limits.registers_per_thread:
        return f"{what} needs {c.registers} registers per thread; the limit is {limits.registers_per_thread}"
    threads = spec.num_warps * limits.warp_size
    if c.registers is not None and c.registers * threads > limits.registers_per_block:
        return (f"{what} needs {c.registers} registers x {threads} threads = {c.registers * threads} per block; "
                f"the limit is {limits.registers_per_block}")  # fmt: skip
    return None


# -- a worker's own device ----------------------------------------------------------------------

TRITON_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def wants_preflight(mode: str, bound) -> bool:
    """`auto`: real GPUs only (simulated devices compute on the CPU); `on`: any GPU; `off`: never."""
    if mode not in PREFLIGHT_MODES:
        raise ValueError(f"Unknown preflight mode `{mode}`. Accepted: {', '.join(PREFLIGHT_MODES)}")
    return bound.type != "cpu" and (mode == "on" or (mode == "auto" and bound.is_real_gpu))


def model_workload(config, dtype) -> Workload:
    """The realistic workload widened by this model's own widths and head dims (each layer's: Gemma 4's
    global layers have their own), in its dtype."""
    name = TRITON_DTYPES[str(dtype).removeprefix("torch.")]
    dims = {config.head_dim, *(getattr(config, "global_head_dim", 0) or config.head_dim,)}
    own = (config.hidden_size, config.intermediate_size, *(config.num_attention_heads * d for d in dims))
    realistic = Workload()
    return Workload(dtype=name, widths=realistic.widths + own, head_dims=realistic.head_dims + tuple(dims))


def device_limits(bound) -> ArchLimits | None:
    """A real GPU's own limits (shared memory per block, warp size) over its table row."""
    import torch

    row = arch_limits(bound.arch_name)
    props = torch.cuda.get_device_properties(0)
    shared = getattr(props, "shared_memory_per_block_optin", None)
    if row is None or not shared:
        return row
    return replace(row, shared_bytes=int(shared), warp_size=int(getattr(props, "warp_size", row.warp_size)),
                   source=f"device properties of {props.name}")  # fmt: skip


def preflight_bound(bound, workload: Workload, jobs: int = 1, skip: Mapping[str, str] | None = None) -> Preflight:
    """The preflight of the device this process is bound to: a real GPU compiles for the target
    its driver reports, checked against its own limits; a simulated one as its description."""
    if bound.is_real_gpu:
        return preflight(bound.type, bound.capability, bound.arch, workload, target=Target.current(),
                         limits=device_limits(bound), jobs=jobs, skip=skip)  # fmt: skip
    return preflight(bound.type, bound.capability, bound.arch, workload, jobs=jobs, skip=skip)


def preflight_or_refuse(bound, workload: Workload, skip: Mapping[str, str] | None = None) -> Preflight:
    """The worker's check before ready (`skip`: the layers its model never runs): `PreflightError`
    naming every refused launch."""
    report = preflight_bound(bound, workload, skip=skip)
    if not report.ok:
        raise PreflightError(f"{len(report.refusals())} kernel launch(es) refused on {report.target}: "
                             + "; ".join(report.refusals()))  # fmt: skip
    return report
