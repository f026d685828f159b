"""What a `hetserve plan --compile --json` device entry must say for every kernel it selected:
compiled for its own target, every launch configuration within the architecture's limits and
without spills, and the fp8 GEMM's tensor-core instruction per architecture. Shared by the
preflight matrix (tests/test_preflight.py, this environment's triton) and the GPU image's own
compile (tests/test_docker_compose.py, the triton torch's CUDA wheel pins)."""

from __future__ import annotations

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
