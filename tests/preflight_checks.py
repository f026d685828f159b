"""What a `hetserve plan --compile --json` device entry must say for every kernel it selected:
compiled for its own target, every launch configuration within the architecture's limits and
without spills. Shared by the preflight matrix (tests/test_preflight.py, this environment's
triton) and the GPU image's own compile (tests/test_docker_compose.py, the triton torch's CUDA
wheel pins)."""

from __future__ import annotations

from workers.kernelize.arch_limits import ARCH_LIMITS


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
