"""What a preflight found, as values: one record per compiled launch, per layer, per device,
and where two such reports disagree.

`hetserve plan --compile`, `/workers` (`kernels.<layer>.compiled`) and the worker's start-up
log read these; `compare` is how a real GPU's own preflight is held against its simulation
(`scripts/gpu_check.sh`). Frozen dataclasses with `to_dict()` for their JSON form; no
compiler, no device here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels_local.compile_spec import Workload
from workers.kernelize.arch_limits import ArchLimits


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
