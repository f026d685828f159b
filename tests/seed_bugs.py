"""The seed bugs of the device-safety core, re-introduced one at a time into a copy of the code.

hetserve exists because four bugs keep coming back in other servers: a process-wide capability
cache, a kernel mapping that keeps only one device type, a device guard that restores only when
its switch succeeded (or not at all), and an fp8 convention not taken from the worker's own
device or rounded twice. `SEED_BUGS` writes each of them (and their kin, at least two per seed)
as a small textual patch of the line that guards against it, with the tests that must then
fail. tests/test_seed_bugs.py asserts that they do, so an edit that weakens one of those tests
fails CI even when nobody runs the mutation testing (scripts/mutation.sh).

Design: `run_all` copies the packages and tests once per bug into a temporary directory and
patches the copy (the patch's text must occur exactly once, so a refactor that moves a guarding
line breaks loudly here instead of silently testing nothing). One interpreter imports the heavy
dependencies (torch, kernels, triton, pytest) once and forks a child per bug; the child puts its
copy first on `sys.path` and runs pytest on the bug's tests. The parent never imports hetserve's
own packages, so each child imports them from its copy. The trade-off: forking a warm
interpreter costs well under a second per bug where a fresh interpreter costs several on a
loaded 2-core machine, at the price of a POSIX-only runner.

Run alone: `python -m tests.seed_bugs` prints one line per bug.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("server", "workers", "kernels_local", "tests", "pyproject.toml")
WARM_MODULES = ("torch", "kernels", "triton", "triton.language", "numpy", "safetensors", "tokenizers")

CACHE = "process-wide capability cache"
MAPPING = "kernel mapping that keeps one device type"
GUARD = "device guard that restores only on success, or not at all"
FP8 = "fp8 convention not from the own device, or rounded twice"
SEEDS = (CACHE, MAPPING, GUARD, FP8)


@dataclass(frozen=True)
class SeedBug:
    """One known bug as a patch: `old` (the guarding text, exactly once in `path`) becomes `new`."""

    seed: str
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail once the bug is in


def _t(module: str, *names: str) -> tuple[str, ...]:
    return tuple(f"tests/{module}.py::{n}" for n in names)


# fmt: off
SEED_BUGS: tuple[SeedBug, ...] = (
    # -- a process-wide capability cache ---------------------------------------------------
    SeedBug(CACHE, "memo-answers-for-any-device", "workers/device/bind.py",
            "    cap = _capability_by_index.get(index)\n",
            "    cap = next(iter(_capability_by_index.values()), None)\n",
            _t("test_device", "test_capability_memo_is_keyed_by_device_index")),
    SeedBug(CACHE, "capability-of-the-current-device", "workers/device/bind.py",
            "torch.cuda.get_device_capability(index)", "torch.cuda.get_device_capability()",
            _t("test_device", "test_capability_memo_is_keyed_by_device_index",
               "test_bind_real_cuda_checks_uuid_and_reads_capability_by_index")),
    SeedBug(CACHE, "capability-read-before-binding", "workers/device/bind.py",
            "    if dev is None:\n        raise DeviceNotBoundError(",
            "    if dev is None and False:\n        raise DeviceNotBoundError(",
            _t("test_device", "test_capability_before_binding_raises")),
    SeedBug(CACHE, "stale-kernels-capability-accepted", "workers/kernelize/crosscheck.py",
            "    if theirs != ours:\n", "    if False:\n",
            _t("test_device", "test_startup_cross_check_refuses_a_stale_kernels_capability")),
    SeedBug(CACHE, "kernelize-ignores-the-mismatch", "workers/kernelize/crosscheck.py",
            "    if not ok:\n        raise KernelCapabilityMismatchError(",
            "    if False:\n        raise KernelCapabilityMismatchError(",
            _t("test_kernelize", "test_real_gpu_refuses_when_kernels_computes_another_capability")),
    # -- a kernel mapping that keeps one device type ----------------------------------------
    SeedBug(MAPPING, "layer-entries-replaced", "kernels_local/mapping.py",
            "per_device = mapping.setdefault(e.layer, {})", "per_device = mapping[e.layer] = {}",
            _t("test_mapping", "test_every_layer_keeps_every_device_type")),
    SeedBug(MAPPING, "resolution-ignores-the-device-type", "kernels_local/mapping.py",
            "if e.layer != layer or e.device.type != device_type:", "if e.layer != layer:",
            _t("test_mapping", "test_select_agrees_with_kernels_own_resolution",
               "test_tuned_variants_by_architecture")),
    SeedBug(MAPPING, "duplicate-device-silently-replaced", "kernels_local/mapping.py",
            "        if e.device in per_device:\n", "        if False:\n",
            _t("test_mapping", "test_duplicate_entry_is_refused")),
    SeedBug(MAPPING, "process-mapping-inherited", "workers/kernelize/apply.py",
            "use_kernel_mapping(mapping, inherit_mapping=False)", "use_kernel_mapping(mapping, inherit_mapping=True)",
            _t("test_kernelize", "test_a_conflicting_mapping_registered_in_the_process_does_not_win")),
    # -- a device guard that restores only on success, or not at all ------------------------
    SeedBug(GUARD, "no-restore-after-a-failed-switch", "workers/device/guard.py",
            "                    except BaseException:\n                        self._restore()\n",
            "                    except BaseException:\n",
            _t("test_guard", "test_restores_even_when_the_switch_failed")),
    SeedBug(GUARD, "restore-owed-only-after-success", "workers/device/guard.py",
            "                self._restore_to = previous if index != previous else None\n"
            "                if self._restore_to is not None:\n"
            "                    try:\n"
            "                        self.platform.set_device(index)\n"
            "                    except BaseException:\n"
            "                        self._restore()\n"
            "                        raise\n",
            "                if index != previous:\n"
            "                    self.platform.set_device(index)\n"
            "                    self._restore_to = previous\n",
            _t("test_guard", "test_restores_even_when_the_switch_failed")),
    SeedBug(GUARD, "never-restores", "workers/device/guard.py",
            "            if self._depth == 0:\n                self._restore()\n",
            "            if self._depth == 0:\n                pass\n",
            _t("test_guard", "test_switches_and_restores_the_callers_device", "test_restores_when_the_body_raises")),
    SeedBug(GUARD, "re-entry-saves-the-switched-device", "workers/device/guard.py",
            "            if self._depth == 0:\n                index = _checked_index(",
            "            if True:\n                index = _checked_index(",
            _t("test_guard", "test_nested_and_reentered_use_restores_exactly_once")),
    SeedBug(GUARD, "negative-index-accepted", "workers/device/guard.py",
            " or not isinstance(index, int) or index < 0:", " or not isinstance(index, int):",
            _t("test_guard", "test_refuses_negative_absent_or_non_integer_index_and_leaves_device_alone")),
    # -- an fp8 convention not from the own device, or rounded twice ------------------------
    SeedBug(FP8, "native-threshold-at-9.0", "workers/contract/fp8_rule.py",
            "NATIVE_FP8_CAPABILITY = Capability(8, 9)", "NATIVE_FP8_CAPABILITY = Capability(9, 0)",
            _t("test_fp8", "test_cuda_choice_threshold")),
    SeedBug(FP8, "convention-from-another-device", "workers/quant/fp8_convention.py",
            "    decision = fp8_rule(device_type, capability)\n", "    decision = fp8_rule(device_type, (9, 0))\n",
            _t("test_fp8", "test_cuda_choice_threshold")
            + _t("test_mapping", "test_fp8_variant_follows_the_fp8_convention")),
    SeedBug(FP8, "mixed-conventions-accepted", "workers/quant/fp8_convention.py",
            "        elif _locked != conv:\n", "        elif False:\n",
            _t("test_fp8", "test_lock_refuses_a_second_convention")),
    SeedBug(FP8, "kernel-of-the-other-convention-accepted", "workers/quant/quantize_model.py",
            "    if choice is not None and choice.fp8 != conv.name:\n", "    if False:\n",
            _t("test_quantize", "test_a_kernel_of_the_other_convention_is_refused")),
    SeedBug(FP8, "activations-through-bfloat16", "workers/quant/fp8_quantize.py",
            "        grid = round_to_e4m3(x32 / scale, conv.fmt)\n",
            "        grid = round_to_e4m3((x32 / scale).to(torch.bfloat16), conv.fmt)\n",
            _t("test_fp8", "test_rounding_happens_in_fp32_before_any_downcast")),
    SeedBug(FP8, "weights-through-float16", "workers/quant/fp8_quantize.py",
            "    w32 = w.to(torch.float32)\n", "    w32 = w.to(torch.float16).to(torch.float32)\n",
            _t("test_fp8", "test_weights_are_rounded_onto_the_grid_in_fp32_not_through_float16")),
    SeedBug(FP8, "scaled-weights-through-float16", "workers/quant/fp8_quantize.py",
            "round_to_e4m3(w32 / scale.unsqueeze(1), conv.fmt)",
            "round_to_e4m3((w32 / scale.unsqueeze(1)).half(), conv.fmt)",
            _t("test_fp8", "test_weights_are_rounded_onto_the_grid_in_fp32_not_through_float16")),
    SeedBug(FP8, "kernel-repo-activations-through-float16", "kernels_local/fp8_linear/quant.py",
            "return round_to_grid(x32 / scale, fmt), scale", "return round_to_grid((x32 / scale).half(), fmt), scale",
            _t("test_fp8_repo_quant", "test_quantize_rows_rounds_in_fp32_before_any_downcast")),
)
# fmt: on


class PatchError(RuntimeError):
    """A seed bug's guarding text is not exactly once in its file: the table needs updating."""


def make_copy(dest: Path) -> Path:
    """The packages, tests and pyproject.toml copied to `dest` (no caches, no model weights)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "default_model")
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


def apply(bug: SeedBug, root: Path) -> None:
    """Patch the copy at `root` with `bug`; `PatchError` unless its text occurs exactly once."""
    path = root / bug.path
    text = path.read_text()
    count = text.count(bug.old)
    if count != 1:
        raise PatchError(f"Seed bug `{bug.name}`: its guarding text occurs {count} times in `{bug.path}`, expected 1")
    path.write_text(text.replace(bug.old, bug.new))


def _warm_up() -> None:
    """Import, once, the third-party modules every child needs (pytest with its own and installed
    plugins, torch, `kernels`, triton) and none of hetserve's: each child imports those from its
    copy. Then freeze the heap, so the children's garbage collections (pytest runs several at
    exit) skip torch's millions of objects."""
    import gc
    import importlib
    import importlib.metadata

    from _pytest.config import default_plugins

    for name in default_plugins:
        importlib.import_module(f"_pytest.{name}")
    for ep in importlib.metadata.entry_points(group="pytest11"):
        try:
            ep.load()
        except Exception:  # a broken plugin fails in the child with its own message
            pass
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()


def _child(root: Path, tests: tuple[str, ...], log: Path) -> None:
    """In the forked child: run `tests` against the copy at `root`, exit with pytest's code."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 3
    try:
        os.chdir(root)
        sys.path.insert(0, str(root))
        import pytest

        quiet = ["-W", "ignore::pytest.PytestAssertRewriteWarning"]  # plugins were imported before pytest ran
        code = int(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *quiet, "--rootdir", str(root), *tests]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def run_all(bugs: tuple[SeedBug, ...] = SEED_BUGS, jobs: int = 2) -> dict[str, dict]:
    """Run every bug's tests against its patched copy (and the unpatched copy against all of them,
    as the baseline "clean"); returns {name: {exit_code, summary, seconds, error}}."""
    _warm_up()
    results: dict[str, dict] = {}
    clean_tests = tuple(dict.fromkeys(t for b in bugs for t in b.tests))
    with tempfile.TemporaryDirectory(prefix="hetserve-seed-bugs-") as tmp:
        work = Path(tmp)
        jobs_left: list[tuple[str, Path, tuple[str, ...]]] = []
        for name, bug in [("clean", None), *((b.name, b) for b in bugs)]:
            root = make_copy(work / name)
            if bug is not None:
                try:
                    apply(bug, root)
                except PatchError as e:
                    results[name] = {"exit_code": None, "summary": "", "seconds": 0.0, "error": str(e)}
                    continue
            jobs_left.append((name, root, clean_tests if bug is None else bug.tests))
        running: dict[int, tuple[str, Path, float]] = {}
        while jobs_left or running:
            while jobs_left and len(running) < max(1, jobs):
                name, root, tests = jobs_left.pop(0)
                log = work / f"{name}.log"
                pid = os.fork()
                if pid == 0:
                    _child(root, tests, log)
                running[pid] = (name, log, time.monotonic())
            pid, status, usage = os.wait4(-1, 0)
            name, log, started = running.pop(pid)
            results[name] = {
                "exit_code": os.waitstatus_to_exitcode(status),
                "summary": _last_line(log),
                "seconds": round(time.monotonic() - started, 2),
                "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
                "error": None,
                "log_tail": log.read_text(errors="replace")[-3000:],
            }
    return results


def main(argv: list[str]) -> int:
    started = time.monotonic()
    results = run_all()
    print(f"all seed bugs: {time.monotonic() - started:.1f}s", file=sys.stderr)
    if argv[:1] == ["--json"]:
        Path(argv[1]).write_text(json.dumps({"bugs": [asdict(b) for b in SEED_BUGS], "results": results}))
        return 0
    for name, r in results.items():
        print(f"{name:42s} exit {r['exit_code']} {r['seconds']:5.1f}s wall {r.get('cpu_seconds', 0):5.1f}s cpu  "
              f"{r['error'] or r['summary']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # the frozen heap is not torn down (triton's bindings would report it as leaked)
