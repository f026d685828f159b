"""Preflight: every Triton kernel a device selects, compiled ahead of time for that device's
target and checked against its limits, before the device serves.

Design: `preflight(device_type, capability, arch, workload)` is pure given the device
description: it runs `kernels_local.mapping.select()` (the worker's own choice), asks each
chosen layer's repository for its launches (`COMPILE_SPECS` in the repository's `layers`:
one entry per Triton layer, declared next to the kernel), compiles each launch for the
device's target (`workers.kernel_compile`) and checks it against the architecture's row in
`workers.arch_limits` (or, on a real GPU, the device's own figures). A launch that needs
more shared memory or registers than the device has is refused with a reason naming the
kernel, the figure and the limit. A tensor-core dot records the instruction it compiled
to and whether it is the one the architecture row expects.

For a GPU whose fp8 rule says "emulated", the preflight also compiles the native fp8
kernel (the layer the mapping gives the first native capability) for this device and
records the compiler's verdict: the reason for emulation, shown by `hetserve plan`.

The same function serves three callers: a worker on a real GPU (its kernelize step,
before ready: a refusal fails the start), `hetserve plan --compile` (one child process
per device running `python -m workers.preflight --arch ...`, each with its own Triton
cache) and CI (the whole matrix of architectures). The trade-off: a cold preflight costs
seconds of compilation per device; Triton's per-architecture cache makes later ones cheap.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from kernels_local.compile_spec import CompileSpec, Workload
from kernels_local.mapping import KernelChoice, select
from workers.arch_limits import ArchLimits, arch_limits
from workers.contract import NATIVE_FP8_CAPABILITY, PREFLIGHT_MODES, ROCM_NATIVE_FP8_CAPABILITY, fp8_rule
from workers.kernel_compile import Compiled, Target, compile_spec

logger = logging.getLogger(__name__)

FP8_LAYER = "Fp8Linear"


class PreflightError(RuntimeError):
    """A selected kernel does not compile for, or does not fit, the device it would run on."""


@dataclass(frozen=True)
class KernelRecord:
    """One launch configuration of one kernel, compiled for one target."""

    kernel: str
    config: str
    target: str
    num_warps: int
    num_stages: int
    ok: bool  # compiled, and fits the device's limits
    shared_bytes: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    instruction: str | None = None
    instruction_ok: bool | None = None  # the architecture's expected tensor-core instruction; None: no dot
    error: str | None = None  # the compiler's message, or why the launch is refused

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class LayerPreflight:
    """The compile records of one layer's chosen kernel (empty for a torch layer)."""

    layer: str
    variant: str
    target: str | None
    records: tuple[KernelRecord, ...] = ()
    note: str | None = None  # why nothing was compiled

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.records)

    @property
    def shared_bytes(self) -> int:
        return max((r.shared_bytes or 0 for r in self.records), default=0)

    @property
    def instruction(self) -> str | None:
        return next((r.instruction for r in self.records if r.instruction), None)

    def compiled(self) -> dict:
        """The `/workers` `kernels.<layer>.compiled` entry: target, shared_bytes, instruction, ok."""
        out = {"target": self.target, "shared_bytes": self.shared_bytes, "instruction": self.instruction, "ok": self.ok}
        errors = [r.error for r in self.records if not r.ok]
        if errors:
            out["error"] = errors[0]
        return out

    def to_dict(self) -> dict:
        """`compiled()` plus every launch configuration's record."""
        return {**self.compiled(), "note": self.note, "configs": [r.to_dict() for r in self.records]}


@dataclass(frozen=True)
class Preflight:
    """One device's preflight: its target and limits, each layer's records, the fp8 proof."""

    arch: str
    target: str | None
    limits: ArchLimits | None
    workload: Workload
    layers: dict[str, LayerPreflight] = field(default_factory=dict)
    native_fp8: KernelRecord | None = None  # the native fp8 kernel compiled where fp8 is emulated

    @property
    def ok(self) -> bool:
        return all(layer.ok for layer in self.layers.values())

    def refusals(self) -> list[str]:
        """Every reason a selected launch cannot run on this device."""
        return [f"{name}: {r.error}" for name, lp in self.layers.items() for r in lp.records if not r.ok]

    def to_dict(self) -> dict:
        w = self.workload
        return {
            "arch": self.arch,
            "target": self.target,
            "ok": self.ok,
            "limits": None if self.limits is None else self.limits.to_dict(),
            "workload": {"dtype": w.dtype, "widths": list(w.widths), "max_tokens": w.max_tokens, "fp8_fmt": w.fp8_fmt,
                         "head_dims": list(w.head_dims)},
            "layers": {name: lp.to_dict() for name, lp in self.layers.items()},
            "native_fp8": None if self.native_fp8 is None else self.native_fp8.to_dict(),
        }


def preflight(device_type: str, capability, arch: str | None = None, workload: Workload | None = None, *,
              target: Target | None = None, limits: ArchLimits | None = None) -> Preflight:  # fmt: skip
    """Compile and check every Triton kernel `select()` picks for this device. Pure given the
    description; `target` and `limits` override the ones derived from it (a real GPU's)."""
    # 1. the device's target, limits and the workload in its fp8 flavour
    decision = fp8_rule(device_type, capability)
    workload = replace(workload or Workload(), fp8_fmt=decision.fmt)
    target = target or Target.for_device(device_type, capability, arch)
    name = target.arch if target is not None else "cpu"
    if limits is None and target is not None:
        limits = arch_limits(target.arch)
    # 2. every chosen layer's launches, compiled and checked
    layers = {}
    for layer, choice in select(device_type, capability).items():
        layers[layer] = _layer(layer, choice, workload, target, limits)
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

_TRITON_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def wants_preflight(mode: str, bound) -> bool:
    """`auto`: real GPUs only (simulated devices compute on the CPU); `on`: any GPU; `off`: never."""
    if mode not in PREFLIGHT_MODES:
        raise ValueError(f"Unknown preflight mode `{mode}`. Accepted: {', '.join(PREFLIGHT_MODES)}")
    return bound.type != "cpu" and (mode == "on" or (mode == "auto" and bound.is_real_gpu))


def model_workload(config, dtype) -> Workload:
    """The realistic workload widened by this model's own widths and head dim, in its dtype."""
    name = _TRITON_DTYPES[str(dtype).removeprefix("torch.")]
    own = (config.hidden_size, config.intermediate_size, config.num_attention_heads * config.head_dim)
    realistic = Workload()
    return Workload(dtype=name, widths=realistic.widths + own, head_dims=realistic.head_dims + (config.head_dim,))


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


def preflight_bound(bound, workload: Workload) -> Preflight:
    """The preflight of the device this process is bound to: a real GPU compiles for the target
    its driver reports, checked against its own limits; a simulated one as its description."""
    if bound.is_real_gpu:
        return preflight(bound.type, bound.capability, bound.arch, workload, target=Target.current(),
                         limits=device_limits(bound))  # fmt: skip
    return preflight(bound.type, bound.capability, bound.arch, workload)


def preflight_or_refuse(bound, workload: Workload) -> Preflight:
    """The worker's check before ready: `PreflightError` naming every refused launch."""
    report = preflight_bound(bound, workload)
    if not report.ok:
        raise PreflightError(f"{len(report.refusals())} kernel launch(es) refused on {report.target}: "
                             + "; ".join(report.refusals()))  # fmt: skip
    return report


# -- python -m workers.preflight ------------------------------------------------------------------

_COMPARED = ("target", "ok", "shared_bytes", "instruction", "instruction_ok", "error")


def compare(a: dict, b: dict) -> list[str]:
    """Where two preflight reports (say a real device's and its simulation's) disagree."""
    diffs = [f"target: {a.get('target')} != {b.get('target')}"] if a.get("target") != b.get("target") else []
    for layer in sorted(set(a["layers"]) | set(b["layers"])):
        ra = {(r["kernel"], r["config"]): r for r in a["layers"].get(layer, {}).get("configs", [])}
        rb = {(r["kernel"], r["config"]): r for r in b["layers"].get(layer, {}).get("configs", [])}
        for key in sorted(set(ra) | set(rb)):
            if key not in ra or key not in rb:
                diffs.append(f"{layer} {key[0]} {key[1]}: only in {'the first' if key in ra else 'the second'}")
                continue
            diffs += [f"{layer} {key[0]} {key[1]}: {f} {ra[key][f]!r} != {rb[key][f]!r}"
                      for f in _COMPARED if ra[key][f] != rb[key][f]]  # fmt: skip
    return diffs


def _as_report(doc: dict) -> dict:
    """A preflight report from this module's JSON, or from `hetserve plan --compile --json` (its
    first device)."""
    if "devices" not in doc:
        return doc
    entry = doc["devices"][0]
    return {"target": entry["preflight"].get("target"),
            "layers": {layer: k.get("compiled", {}) for layer, k in entry["kernels"].items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.preflight",
                                description="Compile every selected Triton kernel for one device and check it.")
    p.add_argument("--arch", help="compile for this architecture (sm_89, gfx942, ...) without touching a device; "
                                  "default: the device this process binds")  # fmt: skip
    p.add_argument("--dtype", choices=tuple(_TRITON_DTYPES), help="model dtype (default: a bfloat16 checkpoint's)")
    p.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="report where two preflights disagree")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.compare:
        a, b = (_as_report(json.loads(Path(f).read_text())) for f in args.compare)
        diffs = compare(a, b)
        print("\n".join(diffs) if diffs else f"agree: {len(a['layers'])} layers on {a['target']}")
        return 1 if diffs else 0
    from workers.device import bind_device
    from workers.loader import choose_dtype
    from workers.topology import TopologySpecError

    try:
        bound = bind_device(args.arch)
    except TopologySpecError as e:
        p.error(str(e))
    dtype, _ = choose_dtype(args.dtype or "auto", "bfloat16", bound.type, bound.capability)
    report = preflight_bound(bound, Workload(dtype=_TRITON_DTYPES[str(dtype).removeprefix("torch.")]))
    print(json.dumps(report.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
