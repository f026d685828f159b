"""The fp8 convention of one worker: native e4m3 or emulated, in the encoding its device takes.

Design: the rule is torch-free (workers/contract/fp8_rule.py), shared with the kernel mapping and
`hetserve plan`; this module turns its decision into one frozen `Fp8Convention`, from which both
the host's buffer dtype (`storage_dtype`) and the kernels' compile-time flag (`native`) are read,
so they cannot disagree. A process locks the first convention it uses and refuses any other
(`MixedFp8ConventionError`), so a buffer made under one never reaches a kernel compiled for the
other. Trade-off: one process never serves two conventions, which is the point (one process, one
device)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from workers.contract import EMULATED, NATIVE, fp8_rule
from workers.quant.e4m3 import FORMATS, E4M3Format


class MixedFp8ConventionError(RuntimeError):
    """A process that already chose one fp8 convention was asked to use another."""


@dataclass(frozen=True)
class Fp8Convention:
    """One device's fp8 convention. `native` is the kernels' constexpr flag; `storage_dtype` the
    host's buffer dtype: both derive from this one value."""

    name: str  # "native_e4m3" | "emulated"
    native: bool
    fmt: str  # "e4m3fn" | "e4m3fnuz"

    @property
    def format(self) -> E4M3Format:
        return FORMATS[self.fmt]

    @property
    def max_value(self) -> float:
        return self.format.max_value

    @property
    def fp8_dtype_name(self) -> str:
        return "float8_e4m3fn" if self.fmt == "e4m3fn" else "float8_e4m3fnuz"

    @property
    def storage_dtype_name(self) -> str:
        return self.fp8_dtype_name if self.native else "uint8"

    @property
    def fp8_dtype(self) -> torch.dtype:
        return getattr(torch, self.fp8_dtype_name)

    @property
    def storage_dtype(self) -> torch.dtype:
        return getattr(torch, self.storage_dtype_name)


NATIVE_E4M3 = Fp8Convention(NATIVE, native=True, fmt="e4m3fn")
EMULATED_E4M3 = Fp8Convention(EMULATED, native=False, fmt="e4m3fn")
NATIVE_E4M3_FNUZ = Fp8Convention(NATIVE, native=True, fmt="e4m3fnuz")
EMULATED_E4M3_FNUZ = Fp8Convention(EMULATED, native=False, fmt="e4m3fnuz")


_CONVENTIONS = {(c.name, c.fmt): c for c in (NATIVE_E4M3, EMULATED_E4M3, NATIVE_E4M3_FNUZ, EMULATED_E4M3_FNUZ)}


def choose_fp8(device_type: str, capability) -> tuple[Fp8Convention, str]:
    """The fp8 convention for one device, with the reason: `workers.contract.fp8_rule`'s
    decision as buffer dtypes. Pure: no device is touched. `capability` is (major, minor);
    90, "9.0" and "sm_90" are accepted too."""
    decision = fp8_rule(device_type, capability)
    return _CONVENTIONS[(decision.convention, decision.fmt)], decision.reason


# -- the process-wide lock ------------------------------------------------------------------

_lock = threading.Lock()
_locked: Fp8Convention | None = None


def lock_convention(conv: Fp8Convention) -> Fp8Convention:
    """Record this process's convention; a different one later raises `MixedFp8ConventionError`."""
    global _locked
    with _lock:
        if _locked is None:
            _locked = conv
        elif _locked != conv:
            raise MixedFp8ConventionError(
                f"This process already uses fp8 convention `{_locked.name}` ({_locked.storage_dtype_name} "
                f"buffers, {_locked.fmt}); refusing `{conv.name}` ({conv.storage_dtype_name}, {conv.fmt}). "
                "One process serves one device with one convention."
            )
        return _locked
