"""What a `hetserve plan --compile --json` device entry must say for every kernel it selected:
compiled for its own target, every launch configuration within the architecture's limits and
without spills, and the fp8 GEMM's tensor-core instruction per architecture. Shared by the
preflight matrix (tests/test_preflight.py, this environment's triton) and the GPU image's own
compile (tests/test_docker_compose.py, the triton torch's CUDA wheel pins)."""

from __future__ import annotations

import functools

from workers.kernelize.arch_limits import ARCH_LIMITS

# Expected tensor-core instruction of the fp8 linear GEMM per architecture (independent of the table).
EXPECTED_GEMM = {
    "sm_70": None, "sm_75": None,  # Fp8Linear is torch there (Triton dots need sm_80)
    "sm_80": r"^mma\.sync.*\.f16\.f16", "sm_86": r"^mma\.sync.*\.f16\.f16", "sm_87": r"^mma\.sync.*\.f16\.f16",
    "sm_89": r"^mma\.sync.*\.e4m3\.e4m3", "sm_120": r"^mma\.sync.*\.e4m3\.e4m3",
    "sm_90": r"^wgmma\.mma_async.*\.e4m3\.e4m3",
    "sm_100": r"^tcgen05\.mma.*kind::f8f6f4", "sm_103": r"^tcgen05\.mma.*kind::f8f6f4",
    "gfx90a": r"^v_mfma_f32_\w+f16$", "gfx942": r"^v_mfma_f32_\w+_fp8_fp8$",
    "gfx950": r"^v_mfma_f32_\w+_(fp8_fp8|f8f6f4)$",
}  # fmt: skip


def assert_every_kernel_compiled_and_fits(entry: dict, arch: str) -> None:
    limits = ARCH_LIMITS[arch]
    assert entry["preflight"]["ok"] is True, entry["preflight"]
    assert entry["preflight"]["limits"]["shared_bytes"] == limits.shared_bytes
    for layer, kernel in entry["kernels"].items():
        compiled = kernel["compiled"]
        assert set(compiled) >= {"target", "shared_bytes", "instruction", "ok"}
        assert compiled["ok"] is True and compiled["target"].startswith(arch), (layer, compiled)
        if "triton" not in kernel["variant"]:
            assert compiled["configs"] == [] and "torch" in compiled["note"]
            continue
        assert compiled["configs"], f"{arch} {layer}: a Triton layer compiled nothing"
        for r in compiled["configs"]:
            assert r["ok"] and r["error"] is None, r
            assert r["shared_bytes"] <= limits.shared_bytes
            assert r["registers"] is not None and 0 < r["registers"] <= limits.registers_per_thread
            assert r["registers"] * r["num_warps"] * limits.warp_size <= limits.registers_per_block
            assert r["spill_bytes"] == 0, f"{arch} {r['kernel']} {r['config']} spills {r['spill_bytes']} bytes"


@functools.cache
def _today_s_matrix() -> dict | None:
    from tests.test_preflight import _recorded, matrix_digest  # imported late: that module imports this one

    plan = _recorded(matrix_digest())
    return None if plan is None else {e["preflight"]["arch"]: e for e in plan["devices"]}


def assert_recorded_launches(layer: str, tuning: str, arch: str, specs, tensor_cores: bool = False) -> None:
    """A kernel repository's tuning, as the preflight matrix compiled it (tests/test_preflight.py,
    compiled again whenever a kernel's source changes): `arch` selects `tuning` for `layer`, and
    every launch `specs` declares was compiled for it, fits and spills nothing. Skips while the
    record is older than the sources (the matrix test compiles and checks every launch then), so
    a repository's tests compile nothing that the matrix already compiled. `tensor_cores`: the
    widest tiles' dots compiled to the architecture's tensor-core instruction."""
    import pytest

    matrix = _today_s_matrix()
    if matrix is None:
        pytest.skip("the preflight matrix record is older than the sources: tests/test_preflight.py compiles it")
    kernel = matrix[arch]["kernels"][layer]
    assert kernel["layer"] == tuning, (arch, kernel["layer"])
    configs = kernel["compiled"]["configs"]
    assert {(s.name, s.config) for s in specs} == {(r["kernel"], r["config"]) for r in configs}, arch
    for r in configs:
        assert r["ok"] and r["spill_bytes"] == 0, (arch, r)
    if tensor_cores:  # the widest tiles, where the architecture's own instruction pays
        top = max(dict(s.constexprs)["BLOCK_M"] for s in specs)
        widest = [r for r in configs if f"BLOCK_M={top} " in r["config"]]
        assert widest and all(r["instruction_ok"] is True for r in widest), (arch, widest)
