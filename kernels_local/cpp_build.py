"""C++ kernels for the CPU: built once per host with torch's extension builder, for its vector ISA.

`build(stem, source, flags)` compiles `source` into torch's extension cache
(`$TORCH_EXTENSIONS_DIR`) under `stem` and a hash of the source and flags, so an edited source or
other flags build anew and a later start only loads. It never raises: without a C++ compiler, or
after a failed build, it gives the reason and the caller keeps its torch path. `vector_flags()`
gives the flags for this CPU's vector instructions and the macro that sizes ATen's `Vectorized` to
them, as Inductor builds its own kernels (torch/_inductor/cpu_vec_isa.py), so a kernel written over
`at::vec::Vectorized` runs the same vector code (and Sleef functions) as torch's own CPU kernels.
Shared by the repositories' CPU kernels (each `cpu.py`), like `compile_spec`; it imports nothing of
them, nor of the worker. The trade-off: a compiler at first use, which Inductor needs anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# this CPU's vector instructions -> the compiler flags for them and the macro that sizes `Vectorized`
ISA_FLAGS = (
    ("avx512", frozenset({"avx512f", "avx512dq", "avx512vl", "avx512bw", "fma"}),
     "-mavx512f -mavx512dq -mavx512vl -mavx512bw -mfma", "CPU_CAPABILITY_AVX512"),
    ("avx2", frozenset({"avx2", "fma", "f16c"}), "-mavx2 -mfma -mf16c", "CPU_CAPABILITY_AVX2"),
)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This host's CPU feature flags (Linux's /proc/cpuinfo names); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())


def vector_flags(have: frozenset[str] | None = None) -> tuple[list[str], str]:
    """The compiler flags for the vector instructions of this CPU (or of one with the flags `have`)
    and their name (`scalar` without any)."""
    have = cpu_flags() if have is None else have
    for name, needs, flags, macro in ISA_FLAGS:
        if needs <= have:
            return ["-O3", "-fopenmp-simd", *flags.split(), f"-D{macro}"], name
    return ["-O3", "-fopenmp-simd"], "scalar"


def build(stem: str, source: Path, flags: list[str], ops: str | None = None, fakes: dict | None = None):
    """(module, None) once `source` is built and imported, or (None, why not). `ops`: the source
    registers operators in that `torch.ops` namespace (`TORCH_LIBRARY_FRAGMENT` over ATen's lighter
    headers: a much shorter build than a pybind11 module's `torch/extension.h`; `CppKernel`'s
    default), and the namespace is returned in place of a module; `fakes` gives some of them their
    shape rules once loaded (`register_fakes`).

    A build survives its builder being killed at any instant: builders of one extension take an
    `flock` on `BUILD_LOCK` in its build directory, which the kernel releases when the holder dies,
    and under it clear torch's own lock file (`lock`, which a killed builder leaves behind and which
    would make every later build wait forever). An extension that was built but does not load (a
    link cut short) is built once more from an empty directory."""
    try:
        import torch
        from torch.utils import cpp_extension

        digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
        name = f"{stem}_{digest}"
        directory = Path(cpp_extension._get_build_directory(name, verbose=False))
        if _deferred is not None and not (directory / f"{name}.so").exists():
            _deferred[name] = (stem, source, list(flags), ops)
            return None, DEFERRED
        with _held(directory / BUILD_LOCK):
            _clear_stale(directory)
            built_from = _pinned_source(directory, source)
            try:
                module = _load(cpp_extension, name, built_from, flags, ops)
            except (ImportError, OSError) as e:  # built, but the library does not load: build it again
                logger.info("C++ kernel %s did not load (%s); building it again", name, e)
                _empty(directory)
                module = _load(cpp_extension, name, _pinned_source(directory, source), flags, ops)
        if ops is not None and fakes:
            register_fakes(ops, fakes)
        return (module if ops is None else getattr(torch.ops, ops)), None
    except Exception as e:  # no compiler, a failed build
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}"


def register_fakes(ops: str, fakes: dict) -> None:
    """Give each operator `name` of the loaded namespace `ops` in `fakes` its shape rule (`fakes[name]`:
    the op's arguments -> an empty output), once per process, so a compiled step calls the C++
    operator itself, not a Python custom op around it (its dispatch and aliasing checks, a few per
    layer: docs/benchmarks.md "Compiled decode step"). The source registers such an operator's kernel for the CPU key
    (`TORCH_LIBRARY_IMPL`): a catch-all kernel would be traced into, and refuses a fake."""
    import torch

    for name, fake in fakes.items():
        qualname = f"{ops}::{name}"
        if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta"):  # `kernels` may import a copy
            torch.library.register_fake(qualname, fake)


DEFERRED = "deferred: building behind the serving"  # `build`'s reason for a build left for later
_deferred: dict[str, tuple] | None = None  # inside `deferring()`: the builds left for later, by name


@contextlib.contextmanager
def deferring():
    """Inside, a `build` whose library is not in the cache yet is not built: it answers (None,
    `DEFERRED`) at once, so its caller keeps its torch path, and is listed for `build_deferred`. A
    cached library loads as usual. A worker serves first this way and builds behind its serving."""
    global _deferred
    previous, _deferred = _deferred, {}
    try:
        yield _deferred
    finally:
        _deferred = previous


_FORGET: list = []  # each deferrable `load()`'s way to forget a deferred answer (`deferrable`)


def deferrable(load):
    """Mark a module's `functools.cache`d `load()` (answering a state with `reason`) as one whose
    deferred answer `forget_deferred` drops; every copy of a module registers its own."""
    def forget() -> None:
        if load.cache_info().currsize and load().reason.startswith(DEFERRED):
            load.cache_clear()

    _FORGET.append(forget)
    return load


def forget_deferred() -> None:
    """Drop every state answered while deferring, so the next `load()` of each finds its library
    built (`build_deferred`) and loads it. Call it where no kernel runs (between engine steps)."""
    for forget in _FORGET:
        forget()
    for kernel in CppKernel.made:
        if kernel._state is not None and DEFERRED in kernel._state.reason:
            kernel.reset()


def build_deferred(pending: dict[str, tuple], workers: int) -> dict[str, str | None]:
    """Build each of `pending` (from `deferring()`), `workers` at a time (each build is a compiler
    child: the caller's interpreter stays free), into the cache; by name, None or why it failed.
    Callers load them afterwards as usual (their `load()` finds them built)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item: tuple) -> str | None:
        return build(*item)[1]

    with ThreadPoolExecutor(max(1, workers)) as pool:
        return dict(zip(pending, pool.map(one, pending.values()), strict=True))


BUILD_LOCK = "hetserve.flock"  # beside torch's `lock`; held with flock while building or loading
TORCH_LOCK = "lock"  # torch.utils.file_baton.FileBaton's file in the build directory


def _load(cpp_extension, name: str, source: Path, flags: list[str], ops: str | None):
    started = time.monotonic()
    module = cpp_extension.load(name, [str(source)], extra_cflags=flags, verbose=False, is_python_module=ops is None)
    if time.monotonic() - started > 5:  # a build, not a load: once per host and source
        logger.info("built C++ kernel %s in %.0f s (once per host; later starts load it)", name,
                    time.monotonic() - started)
    return module


@contextlib.contextmanager
def _held(path: Path):
    """An exclusive `flock` on `path` for the block; the kernel drops it if this process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pinned_source(directory: Path, source: Path) -> Path:
    """A copy of `source` in the build directory, which the build reads: ninja rebuilds when the
    source's path changes, so two checkouts of one tree on a host (whose paths differ) share the
    built library instead of rebuilding it in turn. The digest in the name already pins the bytes."""
    pinned = directory / "src" / source.name
    if not pinned.exists():  # written whole or not at all: a builder may be killed at any instant
        pinned.parent.mkdir(parents=True, exist_ok=True)
        partial = pinned.with_name(f"{pinned.name}.{os.getpid()}.partial")
        shutil.copyfile(source, partial)
        os.replace(partial, pinned)
    return pinned


def _clear_stale(directory: Path) -> None:
    """Remove torch's lock file: under `BUILD_LOCK` no live builder holds it, so a builder that was
    killed left it."""
    stale = directory / TORCH_LOCK
    if stale.exists():
        logger.info("clearing %s, left by a build that was killed; building again", stale)
        stale.unlink(missing_ok=True)


def _empty(directory: Path) -> None:
    """Everything in the build directory but `BUILD_LOCK` (the outputs of a build cut short)."""
    for entry in directory.iterdir():
        if entry.name == BUILD_LOCK:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


OPS = "hetserve_cpu"  # the torch.ops namespace of the CPU kernels `CppKernel` builds


@dataclass(frozen=True)
class CppState:
    """Whether a C++ kernel is loaded in this process, and why (or why not)."""

    available: bool
    reason: str


class CppKernel:
    """One C++ source for this CPU's vector ISA, built (once per host) and loaded on first use in a
    process; `$<env>=off` keeps the caller's torch path. `load()` never raises; `module` is the
    loaded extension (None until `load()` found it). Every instance is listed in `CppKernel.made`:
    the `kernels` library imports a kernel repository under a name of its own, so a process may
    hold two copies of a repository's module, each with its own instance."""

    made: list[CppKernel] = []

    def __init__(self, stem: str, source: Path, env: str, what: str, extra_flags: tuple[str, ...] = (),
                 ops: str | None = OPS, fakes: dict | None = None):
        self.stem, self.source, self.env, self.what, self.extra_flags = stem, source, env, what, extra_flags
        self.ops = ops  # the `torch.ops` namespace the source registers its operators in (None: a pybind11 module)
        self.fakes = fakes  # the shape rules of the operators a compiled step calls (`register_fakes`)
        self.module = None
        self._state: CppState | None = None
        CppKernel.made.append(self)

    @classmethod
    def named(cls, stem: str) -> list[CppKernel]:
        """Every instance made for `stem` in this process."""
        return [k for k in cls.made if k.stem == stem]

    def load(self) -> CppState:
        if self._state is None:
            self._state = self._load()
        return self._state

    def reset(self) -> None:
        """Forget the state (tests switch `$<env>`); a later `load()` looks again."""
        self._state, self.module = None, None

    def _load(self) -> CppState:
        if os.environ.get(self.env, "").lower() in ("off", "0", "false"):
            return CppState(False, f"${self.env}=off: the torch reference")
        flags, isa = vector_flags()
        self.module, why = build(self.stem, self.source, [*flags, *self.extra_flags], self.ops, self.fakes)
        if why == DEFERRED:
            return CppState(False, f"{self.what}: {DEFERRED}; the torch reference meanwhile")
        if self.module is None:  # no compiler, a failed build: the torch reference serves
            logger.warning("%s unavailable (%s); the torch reference serves", self.what, why)
            return CppState(False, f"{self.what} unavailable ({why.split(':')[0]}): the torch reference")
        return CppState(True, f"{self.what} ({isa})")
