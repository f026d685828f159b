"""Preflight: the whole CI matrix (every claimed architecture x every selected kernel and
launch configuration) compiles ahead of time and fits, with the expected tensor-core
instruction; the native fp8 kernel fails below sm_89; an oversized launch is refused.

The matrix is one real `hetserve plan --compile --simulate <all> --json` run (real CLI, one
real preflight child per architecture), shared by the tests of this file. Compilation goes
through Triton's cache in `.cache/triton-preflight/<arch>/`, so a repeated suite reads binaries.
A fresh clone has no cache, so the plan is also kept in `tests/preflight_matrix.json.gz` under a
digest of everything it depends on (the kernel repositories, the preflight, the contract, the
device binding, the plan command, Triton's and torch's versions): the matrix is compiled only
when that digest changes, and the run rewrites the file. Every run still compiles sm_90 afresh
and compares it with the matrix record for record
(`test_a_devices_own_preflight_agrees_with_the_plan_for_its_architecture`).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload
from kernels_local.mapping import select
from tests.preflight_checks import EXPECTED_GEMM, assert_every_kernel_compiled_and_fits
from workers.contract import ENV_TRITON_CACHE
from workers.kernelize.arch_limits import ARCH_LIMITS, PREFLIGHT_ARCHS

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "triton-preflight"
# A cold matrix on two busy cores can take longer than the suite's default per-test limit.
pytestmark = pytest.mark.timeout(3000)
compiles_here = pytest.mark.skipif(type(tl.sum).__name__ == "InterpretedFunction",
                                   reason="TRITON_INTERPRET=1: kernels are interpreted, not compiled")  # fmt: skip
BELOW_SM89 = ("sm_70", "sm_75", "sm_80", "sm_86", "sm_87")


def preflight_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, ENV_TRITON_CACHE: str(CACHE), **extra}


RECORD = ROOT / "tests" / "preflight_matrix.json.gz"
# what the matrix's plan depends on: a change to any file below these paths compiles it again
DEPENDS = ("kernels_local", "workers/kernelize", "workers/contract", "workers/device", "workers/model/loader.py",
           "server/commands", "server/fleet/spec.py", "server/cli.py")  # fmt: skip


class Matrix(dict):
    """The plan's device entries by architecture; `compiled` says whether this run compiled them."""

    compiled = False


def matrix_digest() -> str:
    """sha256 over the versions of Triton and torch, the architectures, and every source file the
    plan depends on (path and bytes)."""
    import torch
    import triton

    h = hashlib.sha256(f"{triton.__version__} {torch.__version__} {PREFLIGHT_ARCHS}".encode())
    for dep in DEPENDS:
        base = ROOT / dep
        files = [base] if base.is_file() else sorted(base.rglob("*"))
        for f in files:
            # not the C++ sources: they build only for the host's own CPU, never for the plan's architectures
            if f.is_file() and f.suffix in (".py", ".json") and "__pycache__" not in f.parts:
                h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _recorded(digest: str) -> dict | None:
    if not RECORD.exists():
        return None
    doc = json.loads(gzip.decompress(RECORD.read_bytes()).decode().replace("<root>", str(ROOT)))
    return doc["plan"] if doc.get("digest") == digest else None


@pytest.fixture(scope="session")
def matrix() -> Matrix:
    """`hetserve plan --compile --json` over every architecture of the limits table, by arch:
    compiled when the recorded plan's digest is not the sources' (then recorded), else read."""
    digest = matrix_digest()
    plan = _recorded(digest)
    compiled = plan is None
    if compiled:
        cmd = [sys.executable, "-m", "server.cli", "plan", "--compile", "--simulate", ",".join(PREFLIGHT_ARCHS),
               "--json"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=preflight_env(), capture_output=True, text=True, timeout=3000)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        plan = json.loads(proc.stdout)
        text = json.dumps({"digest": digest, "plan": plan}, separators=(",", ":"), sort_keys=True)
        RECORD.write_bytes(gzip.compress(text.replace(str(ROOT), "<root>").encode(), mtime=0))
    found = Matrix((e["preflight"]["arch"], e) for e in plan["devices"])
    found.compiled = compiled
    return found


def test_a_kernel_change_changes_the_digest(tmp_path, monkeypatch):
    """Guards the walk over `DEPENDS` in `matrix_digest`: a byte changed in a kernel repository's
    source gives another digest, so the matrix is compiled again rather than read."""
    me = sys.modules[__name__]
    repo = tmp_path / "kernels_local" / "rmsnorm"
    repo.mkdir(parents=True)
    (repo / "rmsnorm.py").write_text("BLOCK = 64\n")
    monkeypatch.setattr(me, "ROOT", tmp_path)
    monkeypatch.setattr(me, "DEPENDS", ("kernels_local",))
    before = matrix_digest()
    (repo / "rmsnorm.py").write_text("BLOCK = 128\n")
    after = matrix_digest()
    assert after != before
    (repo / "notes.txt").write_text("not source")
    assert matrix_digest() == after


def test_the_matrix_covers_every_claimed_architecture(matrix):
    assert PREFLIGHT_ARCHS == ("sm_70", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_103",
                               "sm_120", "gfx90a", "gfx942", "gfx950")  # fmt: skip
    assert sorted(matrix) == sorted(PREFLIGHT_ARCHS)


@pytest.mark.parametrize("arch", PREFLIGHT_ARCHS)
def test_every_selected_kernel_compiles_and_fits(matrix, arch):
    assert_every_kernel_compiled_and_fits(matrix[arch], arch)


@pytest.mark.parametrize("arch", PREFLIGHT_ARCHS)
def test_fp8_gemm_uses_the_expected_tensor_core_instruction(matrix, arch):
    kernel = matrix[arch]["kernels"]["Fp8Linear"]
    gemm = [r for r in kernel["compiled"]["configs"] if r["kernel"] == "_fp8_linear_kernel"]
    if EXPECTED_GEMM[arch] is None:
        assert gemm == [] and kernel["variant"] == "emulated-torch"
        return
    # every launch the token counts select: 16..64 rows (64..128 on Hopper and Blackwell tiles), +/- bias
    assert len(gemm) >= 4
    for r in gemm:
        assert r["instruction"] and re.search(EXPECTED_GEMM[arch], r["instruction"]), (arch, r["config"], r)
        assert r["instruction_ok"] is True
        native = matrix[arch]["fp8"]["convention"] == "native_e4m3"
        assert f"NATIVE={native}" in r["config"]
    assert matrix[arch]["kernels"]["Fp8Linear"]["compiled"]["instruction"] == gemm[0]["instruction"]


@pytest.mark.parametrize("arch", BELOW_SM89)
def test_native_fp8_fails_to_compile_below_sm89_and_the_plan_says_why(matrix, arch):
    fp8 = matrix[arch]["fp8"]
    assert fp8["convention"] == "emulated"
    proof = fp8["native_compile"]
    assert proof["ok"] is False and proof["target"] == arch and "NATIVE=True" in proof["config"]
    assert "type fp8e4nv not supported in this architecture" in proof["error"]


@pytest.mark.parametrize("arch", ["sm_89", "sm_90", "sm_100", "sm_103", "sm_120", "gfx942", "gfx950"])
def test_native_fp8_compiles_at_and_above_sm89(matrix, arch):
    entry = matrix[arch]
    assert entry["fp8"]["convention"] == "native_e4m3" and "native_compile" not in entry["fp8"]
    gemm = [r for r in entry["kernels"]["Fp8Linear"]["compiled"]["configs"] if r["kernel"] == "_fp8_linear_kernel"]
    assert gemm and all(r["ok"] and "NATIVE=True" in r["config"] for r in gemm)


def test_gfx90a_native_fp8_compiles_only_without_fp8_matrix_instructions(matrix):
    """CDNA2 has no fp8 MFMA: Triton builds the native kernel from scalar conversions."""
    proof = matrix["gfx90a"]["fp8"]["native_compile"]
    assert proof["target"] == "gfx90a" and proof["ok"] is True and proof["instruction"] is None
    from server.commands.plan import _render

    assert "native fp8 kernel on gfx90a (_fp8_linear_kernel): compiles, but only without fp8 matrix" in _render(
        {"devices": [matrix["gfx90a"]]})


def test_gfx950_compiles_ocp_e4m3fn_and_gfx942_fnuz(matrix):
    for arch, fnuz in (("gfx950", False), ("gfx942", True)):
        entry = matrix[arch]
        assert entry["preflight"]["workload"]["fp8_fmt"] == ("e4m3fnuz" if fnuz else "e4m3fn")
        gemm = [r for r in entry["kernels"]["Fp8Linear"]["compiled"]["configs"] if r["kernel"] == "_fp8_linear_kernel"]
        assert all(f"FNUZ={fnuz}" in r["config"] for r in gemm)


def test_each_architecture_compiles_into_its_own_triton_cache(matrix):
    dirs = {arch: Path(e["preflight"]["triton_cache"]) for arch, e in matrix.items()}
    assert dirs == {arch: CACHE / arch for arch in PREFLIGHT_ARCHS}
    if matrix.compiled:  # a recorded matrix compiled into the caches of the run that recorded it
        for arch in PREFLIGHT_ARCHS:
            assert any(dirs[arch].iterdir()), f"nothing was compiled into {dirs[arch]}"


def test_the_table_reads_as_the_plan_plus_compile_records(matrix):
    from server.commands.plan import _render

    text = _render({"devices": [matrix["sm_80"], matrix["sm_90"]]})
    assert "native fp8 kernel on sm_80 (_fp8_linear_kernel): does not compile: type fp8e4nv not supported" in text
    assert re.search(r"_fp8_linear_kernel on sm_90a: 4/4 configurations ok, shared <= \d+ B.*wgmma", text)
    assert f"preflight sm_90a: ok; limits {ARCH_LIMITS['sm_90'].shared_bytes} B shared/block" in text
    assert f"triton cache {CACHE / 'sm_80'}" in text


def test_a_devices_own_preflight_agrees_with_the_plan_for_its_architecture(matrix, tmp_path):
    """What `scripts/gpu_check.sh` does on a real GPU, here with a device bound by its
    description: `python -m workers.kernelize` and `hetserve plan --compile` must agree record
    for record, and `--compare` names any difference. On sm_70, the architecture with the fewest
    launches to compile (a cold cache pays for each)."""
    from workers.kernelize.cli import main

    own = subprocess.run([sys.executable, "-m", "workers.kernelize", "--arch", "sm_70", "--jobs", "2"], cwd=ROOT,
                         capture_output=True, text=True, env=preflight_env(TRITON_CACHE_DIR=str(CACHE / "sm_70")),
                         timeout=600)  # fmt: skip
    assert own.returncode == 0, own.stderr[-2000:]
    a, b = tmp_path / "own.json", tmp_path / "plan.json"
    a.write_text(own.stdout)
    b.write_text(json.dumps({"devices": [matrix["sm_70"]]}))
    assert main(["--compare", str(a), str(b)]) == 0
    changed = json.loads(json.dumps(matrix["sm_70"]))
    changed["kernels"]["RMSNorm"]["compiled"]["configs"][0]["shared_bytes"] += 1
    b.write_text(json.dumps({"devices": [changed]}))
    assert main(["--compare", str(a), str(b)]) == 1


# -- refusal -----------------------------------------------------------------------------------


def _oversized_gemm() -> CompileSpec:
    """The fp8 GEMM with Hopper-sized tiles and 5 stages: about 160 KiB of shared memory."""
    from kernels_local.fp8_linear.fp8_linear import compile_specs
    from kernels_local.fp8_linear.layers import SM90

    spec = compile_specs(SM90, Workload(widths=(4096,), max_tokens=128), native=True)[2]
    assert "BLOCK_M=128" in spec.config and "HAS_BIAS=False" in spec.config
    return CompileSpec(spec.kernel, spec.args, spec.constexprs, spec.num_warps, 6, spec.dot)


@compiles_here
def test_an_oversized_launch_is_refused_naming_kernel_figure_and_limit(monkeypatch):
    """Guards `_exceeds` in workers/kernelize/preflight.py: a launch that needs more shared memory than
    sm_89's 99 KiB is refused, not left to fail with `out of resource` at the first request."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(CACHE / "sm_89"))
    from workers.kernelize.aot import Target, compile_spec
    from workers.kernelize.preflight import check

    spec, target = _oversized_gemm(), Target("cuda", "sm_89", 32)
    compiled = compile_spec(spec, target)
    assert compiled.ok and compiled.shared_bytes > ARCH_LIMITS["sm_89"].shared_bytes
    record = check(spec, compiled, target, ARCH_LIMITS["sm_89"])
    assert record.ok is False
    assert record.error == (
        f"`_fp8_linear_kernel` ({spec.config}) on sm_89 needs {compiled.shared_bytes} bytes of shared memory per "
        f"block; the limit is {ARCH_LIMITS['sm_89'].shared_bytes}"
    )
    # the same launch fits Hopper's 227 KiB
    assert check(spec, compiled, target, ARCH_LIMITS["sm_90"]).ok


@compiles_here
def test_a_worker_refuses_a_selection_that_does_not_fit(monkeypatch):
    """Guards `preflight_or_refuse`: the kernelize step raises with every refused launch."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(CACHE / "sm_89"))
    from kernels_local.fp8_linear import layers
    from workers.device.bind import BoundDevice
    from workers.kernelize.preflight import PreflightError, preflight_or_refuse

    monkeypatch.setitem(layers.COMPILE_SPECS, "Fp8LinearTritonNativeSm89", lambda workload: (_oversized_gemm(),))
    # the other layers fit (the matrix shows it) and are not compiled again here: noted as skipped
    skip = {layer: "not under test" for layer in select("cuda", (8, 9)) if layer != "Fp8Linear"}
    bound = BoundDevice("cuda", 0, "GPU-x", "NVIDIA L40S (simulated)", (8, 9), 48 << 30, True, "sm_89")
    with pytest.raises(PreflightError, match=r"1 kernel launch\(es\) refused on sm_89: Fp8Linear: `_fp8_linear_kernel`"
                                             r" .* needs \d+ bytes of shared memory per block; the limit is 101376"):
        preflight_or_refuse(bound, Workload(), skip=skip)


def test_a_triton_layer_without_compile_specs_is_an_error(monkeypatch):
    from workers.kernelize.preflight import PreflightError, compile_specs_of

    monkeypatch.setattr("kernels_local.rmsnorm.layers.COMPILE_SPECS", {})
    with pytest.raises(PreflightError, match="`kernels_local/rmsnorm:RMSNormTritonSm90` is a Triton layer"):
        compile_specs_of(select("cuda", (9, 0))["RMSNorm"])


def test_plan_compile_exits_1_when_a_device_is_refused(monkeypatch, capsys):
    from server.cli import main
    from server.commands import plan_compile

    def refused(devices, jobs=None):
        return [{"arch": d.arch_name, "ok": False, "error": "boom", "layers": {}, "native_fp8": None} for d in devices]

    monkeypatch.setattr(plan_compile, "preflight_reports", refused)
    assert main(["plan", "--compile", "--simulate", "sm_89"]) == 1
    assert "preflight FAILED: boom" in capsys.readouterr().out


def test_the_worker_flag_and_its_environment_default(monkeypatch, capsys):
    from workers.main import parse_args

    assert parse_args(["--socket", "s"]).preflight == "auto"
    monkeypatch.setenv("HETSERVE_PREFLIGHT", "on")
    assert parse_args(["--socket", "s"]).preflight == "on"
    assert parse_args(["--socket", "s", "--preflight", "off"]).preflight == "off"
    monkeypatch.setenv("HETSERVE_PREFLIGHT", "bogus")
    with pytest.raises(SystemExit):
        parse_args(["--socket", "s"])
    assert "`$HETSERVE_PREFLIGHT=bogus` is not a preflight mode. Accepted: auto, on, off" in capsys.readouterr().err


def test_when_a_worker_runs_its_preflight_and_on_what():
    from tests.test_kernelize import device
    from workers.kernelize.preflight import model_workload, wants_preflight
    from workers.model.config import ModelConfig

    assert wants_preflight("auto", device("sm_90", simulated=False))
    assert not wants_preflight("auto", device("sm_90")) and wants_preflight("on", device("sm_90"))
    assert not wants_preflight("on", device("cpu")) and not wants_preflight("off", device("sm_90", simulated=False))
    with pytest.raises(ValueError, match="`sometimes`"):
        wants_preflight("sometimes", device("sm_90"))
    cfg = ModelConfig(vocab_size=32, hidden_size=48, intermediate_size=136, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)  # fmt: skip
    import torch

    w = model_workload(cfg, torch.float16)
    assert w.dtype == "fp16" and {48, 136, 256, 16384} <= set(w.widths)  # its own widths and the realistic ones
    assert w.head_dims == (24, 64, 128, 256, 512)  # its own head dim (48 / 2 heads) and the realistic ones
    gemma4 = dataclasses.replace(cfg, architecture="gemma4", num_hidden_layers=2, sliding_window=8,
                                 layer_types=("sliding_attention", "full_attention"), global_head_dim=40)
    assert {24, 40} <= set(model_workload(gemma4, torch.float16).head_dims)  # each layer type's head dim


# -- a worker's own preflight, end to end ------------------------------------------------------


def test_a_worker_with_preflight_reports_compile_records_and_its_cache(matrix, tmp_path):
    """A real worker process (simulated sm_80, `--preflight on`, `--quantize fp8`) compiles its
    kernels in its kernelize step and `/capability` carries the records, the native fp8 verdict and
    its architecture's cache directory. Guards `_never_run` in workers/main.py: the layers the
    model never runs (a dense model of bf16 weights: no experts, no checkpoint's 4-bit or fp8 layers)
    are noted, not compiled."""
    import httpx

    sock, status = tmp_path / "w.sock", tmp_path / "w.json"
    env = preflight_env(HETSERVE_PREFLIGHT="on")
    env.pop("TRITON_CACHE_DIR", None)
    proc = subprocess.Popen([sys.executable, "-m", "workers", "--socket", str(sock), "--simulate", "sm_80",
                             "--status-file", str(status), "--threads", "1", "--max-batch", "2", "--quantize", "fp8"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        info = _wait_capability(proc, sock, status, httpx)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert info["triton_cache"] == str(CACHE / "sm_80")
    for layer, kernel in info["kernels"].items():
        assert kernel["compiled"]["target"] == "sm_80" and kernel["compiled"]["ok"] is True, layer
    assert info["kernels"]["Fp8Linear"]["compiled"]["instruction"].startswith("mma.sync")
    for layer in ("FusedMoE", "Fp8FusedMoE", "Mxfp4FusedMoE", "Fp8CheckpointLinear", "Int4CheckpointLinear"):
        assert info["kernels"][layer]["compiled"]["shared_bytes"] == 0, layer  # compiled, each GEMM stages tiles
    assert info["kernels"]["LoraDelta"]["compiled"]["shared_bytes"] > 0, "adapters may come while it serves"
    assert "fp8e4nv not supported" in info["fp8"]["native_compile"]["error"]


def _wait_capability(proc, sock, status, httpx) -> dict:
    import time

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited {proc.returncode}: {proc.stderr.read().decode()[-3000:]}")
        if status.exists() and '"ready"' in status.read_text():
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=30) as c:
                return c.get("http://w/capability").json()
        time.sleep(0.2)
    raise AssertionError("the worker did not become ready")


# -- on a real GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
def test_the_real_device_agrees_with_its_simulation():
    from workers.device.bind import bind_device
    from workers.kernelize.preflight import preflight, preflight_bound
    from workers.kernelize.records import compare

    bound = bind_device()
    real = preflight_bound(bound, Workload())
    simulated = preflight(bound.type, bound.capability, bound.arch_name, Workload())
    assert real.ok, real.refusals()
    assert compare(real.to_dict(), simulated.to_dict()) == []
    assert real.limits.shared_bytes == simulated.limits.shared_bytes  # the device's figure = the table's
