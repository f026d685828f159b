"""`hetserve plan --compile`: each device's kernels compiled ahead of time, by the workers' own
preflight, without any GPU.

Design: the router does not import the preflight (it imports only the workers' torch-free
contract). It runs `python -m workers.kernelize --arch <arch>` once per device, each child
with the environment a worker of that device would get (its architecture's own Triton
cache directory, set before Python starts) but no visible GPU, and reads the JSON report
from its stdout. Children run side by side, up to one per CPU, so the matrix of a
mixed host costs about its slowest devices. The reports are attached to the plan under
the same names `/workers` uses (`kernels.<layer>.compiled`), with the native fp8 verdict
under `fp8.native_compile`. The trade-off: each child pays the import of torch and Triton
(seconds) for the isolation of one process, and one cache directory, per architecture.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from server.fleet.spec import available_cpus, worker_environment
from workers.contract import ENV_TRITON_CACHE_DIR, DeviceInfo

CHILD_TIMEOUT_S = 1800  # a cold matrix on two busy cores takes minutes per architecture


def preflight_reports(devices: list[DeviceInfo], jobs: int | None = None) -> list[dict]:
    """One preflight report per device (same order); a failed child gives `{"ok": False, "error"}`."""
    with ThreadPoolExecutor(max(1, min(jobs or available_cpus(), len(devices) or 1))) as pool:
        return list(pool.map(_run_child, devices))


def _run_child(device: DeviceInfo) -> dict:
    env = worker_environment(device, 1, _base_env())
    env["CUDA_VISIBLE_DEVICES"] = ""  # compile only: no device is touched
    cmd = [sys.executable, "-m", "workers.kernelize", "--arch", device.arch_name]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return _failed(device, f"the preflight of `{device.arch_name}` took over {CHILD_TIMEOUT_S} s", env)
    seconds = round(time.perf_counter() - t0, 2)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return _failed(device, f"`{' '.join(cmd[1:])}` exited {proc.returncode}: {tail}", env)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return _failed(device, f"`{' '.join(cmd[1:])}` printed no JSON report", env)
    return {**report, "triton_cache": env[ENV_TRITON_CACHE_DIR], "seconds": seconds}


def _base_env() -> dict[str, str]:
    # The interpreter would make the kernels plain Python functions with nothing to compile.
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _failed(device: DeviceInfo, error: str, env: dict) -> dict:
    return {"arch": device.arch_name, "ok": False, "error": error, "layers": {}, "native_fp8": None,
            "triton_cache": env.get(ENV_TRITON_CACHE_DIR)}  # fmt: skip


def attach(entry: dict, report: dict) -> None:
    """Put one device's preflight report into its plan entry, in `/workers`' names."""
    for layer, kernel in entry["kernels"].items():
        compiled = report["layers"].get(layer)
        kernel["compiled"] = compiled if compiled is not None else {"ok": False, "error": report.get("error")}
    if report.get("native_fp8") is not None:
        entry["fp8"]["native_compile"] = report["native_fp8"]
    keys = ("arch", "target", "ok", "error", "limits", "workload", "triton_cache", "seconds")
    entry["preflight"] = {k: report[k] for k in keys if k in report}


# -- the table ------------------------------------------------------------------------------


def render_preflight(entry: dict) -> list[str]:
    """The lines under a device in `hetserve plan --compile`'s table."""
    pf = entry.get("preflight")
    if pf is None:
        return []
    if pf.get("error"):
        return [f"  preflight FAILED: {pf['error']}"]
    limits = pf.get("limits")
    head = f"  preflight {pf['target'] or 'cpu'}: {'ok' if pf['ok'] else 'REFUSED'}"
    if limits:
        head += (f"; limits {limits['shared_bytes']} B shared/block, "
                 f"{limits['registers_per_thread']} registers/thread, "
                 f"{limits['registers_per_block']}/block, warp {limits['warp_size']}")
    lines = [head, f"  triton cache {pf.get('triton_cache')}"]
    native = entry["fp8"].get("native_compile")
    if native is not None:
        if not native["ok"]:
            verdict = f"does not compile: {native['error']}"
        elif native["instruction"] is None:
            verdict = "compiles, but only without fp8 matrix instructions (none on this architecture)"
        else:
            verdict = f"compiles ({native['instruction']})"
        lines.append(f"  native fp8 kernel on {native['target']} ({native['kernel']}): {verdict}")
    return lines


def render_layer(kernel: dict) -> list[str]:
    """One line per compiled kernel function of a layer: configurations, worst figures, instruction."""
    compiled = kernel.get("compiled")
    if not compiled:
        return []
    if not compiled.get("configs"):
        return [f"      {compiled.get('note') or compiled.get('error') or 'nothing compiled'}"]
    lines = []
    by_kernel: dict[str, list[dict]] = {}
    for r in compiled["configs"]:
        by_kernel.setdefault(r["kernel"], []).append(r)
    for name, records in by_kernel.items():
        bad = [r for r in records if not r["ok"]]
        instr = {r["instruction"] for r in records if r["instruction"]}
        line = (f"      {name} on {records[0]['target']}: {len(records) - len(bad)}/{len(records)} configurations ok, "
                f"shared <= {max(r['shared_bytes'] or 0 for r in records)} B, "
                f"registers <= {max(r['registers'] or 0 for r in records)}, "
                f"spills <= {max(r['spill_bytes'] or 0 for r in records)} B")  # fmt: skip
        if instr:
            wrong = [r for r in records if r["instruction_ok"] is False]
            line += f", {' | '.join(sorted(instr))}" + (" (NOT the expected instruction)" if wrong else "")
        lines.append(line)
        lines += [f"        REFUSED {r['config']}: {r['error']}" for r in bad]
    return lines
