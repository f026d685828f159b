"""The GGUF rule per device and what a worker says it does with a file's blocks (workers/gguf/execution.py).

The rule keeps the blocks packed on CUDA from sm_70 and on ROCm (kernels_local/gguf_linear's Triton
kernels), on the CPU for the types its C++ GEMV decodes where that kernel loads, and dequantizes
them at load below sm_70 and on a CPU without the kernel, each with its reason; the description of a
served file names what the loader did (without the loaded model: dequantized at load; with it,
tests/test_gguf_packed.py) beside the rule, and counts the file's bytes."""

from __future__ import annotations

import pytest
import torch

from workers.contract.gguf_rule import CPU_PACKED_TYPES, PACKED_TYPES
from workers.gguf.execution import DEQUANTIZED, KERNEL, PACKED, gguf_execution, gguf_rule

pytest.importorskip("gguf")


@pytest.mark.parametrize(("device", "cap", "execution", "where"), [
    ("cpu", None, PACKED, "CPU"), ("cuda", (6, 1), DEQUANTIZED, "sm_61"), ("cuda", (7, 0), PACKED, "sm_70"),
    ("cuda", (8, 6), PACKED, "sm_86"), ("cuda", (12, 0), PACKED, "sm_120"), ("rocm", (9, 4), PACKED, "ROCm"),
])  # fmt: skip
def test_the_rule_per_device_with_its_reason(device, cap, execution, where):
    """Guards the rule's threshold (`FIRST_PACKED_CUDA`) and its ROCm branch: sm_61 dequantizes, sm_70 keeps
    the blocks packed, ROCm too."""
    rule = gguf_rule(device, cap)
    assert rule.execution == execution and rule.reason.startswith(f"{where}: ")
    assert rule.kernel == (KERNEL if execution == PACKED else None)
    kept = set(CPU_PACKED_TYPES) if device == "cpu" else set(PACKED_TYPES) if rule.kernel else set()
    assert set(rule.types) == kept
    if device == "cpu":
        assert "C++ GEMV" in rule.reason and "Q4_K" in rule.reason


def test_a_cpu_without_the_kernel_dequantizes_at_load_and_says_why(monkeypatch):
    """Guards `_cpu_rule`'s unavailable branch: with the kernel off (as where it does not build) the CPU
    dequantizes at load and names the kernel's reason."""
    from kernels_local.gguf_linear import cpu

    monkeypatch.setenv(cpu.ENV_CPU_GGUF, "off")
    cpu.KERNEL.reset()
    try:
        rule = gguf_rule("cpu")
    finally:
        monkeypatch.delenv(cpu.ENV_CPU_GGUF)
        cpu.KERNEL.reset()
    assert rule.execution == DEQUANTIZED and rule.types == () and rule.kernel is None
    assert rule.reason.startswith("CPU: blocks dequantized at load") and cpu.ENV_CPU_GGUF in rule.reason


def test_the_cpu_types_are_the_cpu_kernels():
    """Guards `CPU_PACKED_TYPES`: the router counts as packed on the CPU exactly the types the kernel decodes."""
    from kernels_local.gguf_linear import cpu

    assert set(CPU_PACKED_TYPES) == set(cpu.TYPES) and set(CPU_PACKED_TYPES) <= set(PACKED_TYPES)


def test_a_served_file_says_what_the_loader_did_beside_its_devices_rule(tmp_path):
    from tests.gguf_checkpoints import make_gguf
    from workers.gguf.prepare import prepare

    directory = prepare(make_gguf("llama", "Q8_0", tmp_path), tmp_path / "cache")
    for device, cap, execution in (("cpu", None, PACKED), ("sm_86", None, PACKED), ("cuda", (6, 1), DEQUANTIZED),
                                   ("gfx942", None, PACKED), ("cuda", (9, 0), PACKED)):  # fmt: skip
        described = gguf_execution(directory, torch.float32, device, cap)
        assert described["execution"] == "dequantized at load to float32", described
        assert described["rule"]["execution"] == execution, (device, described)
        assert described["reason"].startswith(described["rule"]["reason"]) and described["packed_layers"] == 0
        assert set(described["types"]) == {"F32", "Q8_0"}
        assert 0 < described["packed_bytes"] < described["resident_bytes"]
    assert gguf_execution(tmp_path, torch.float32, "cpu") is None  # no prepared GGUF directory
