"""The kernel mapping and `select()`: coverage, purity, agreement with `kernels`' own
resolution and with the fp8 convention rule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kernels import CUDAProperties, Device, Mode, ROCMProperties, use_kernel_mapping
from kernels.layer.globals import _KERNEL_MAPPING

from kernels_local.mapping import (
    DEVICE_TYPES,
    LAYERS,
    KernelChoice,
    _cuda,
    _declare,
    _Entry,
    _rocm,
    kernel_mapping,
    select,
)

ROOT = Path(__file__).resolve().parents[1]

CUDA_CAPS = [(major, minor) for major in range(7, 13) for minor in range(10)]  # sm_70 .. sm_129
ROCM_CAPS = [(9, 0), (9, 4), (9, 5), (10, 3), (11, 0), (12, 0)]  # gfx90a, gfx942, gfx950, RDNA


def test_every_layer_keeps_every_device_type():
    """Regression guard for `per_device = mapping.setdefault(e.layer, {})` in
    kernels_local/mapping.py::_declare: assigning `mapping[layer] = {device: repo}` per entry
    kept only the last device type of each layer (a `{"cuda": ..., "rocm": ...}` mapping
    whose entries overwrote each other)."""
    for layer in LAYERS:
        assert {d.type for d in kernel_mapping()[layer]} == set(DEVICE_TYPES), layer
    # ... and `kernels` keeps them all once registered
    with use_kernel_mapping(kernel_mapping(), inherit_mapping=False):
        registered = _KERNEL_MAPPING.get()
        for layer in LAYERS:
            assert set(registered[layer]) == set(DEVICE_TYPES), layer


def test_duplicate_entry_is_refused():
    e = _Entry("RMSNorm", Device(type="cpu"), "rmsnorm", "RMSNorm", "torch", "x")
    with pytest.raises(ValueError, match="Duplicate kernel mapping entry for `RMSNorm`"):
        _declare((e, e))


@pytest.mark.parametrize("cap", CUDA_CAPS, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_cuda_coverage_without_gaps(cap):
    choices = select("cuda", cap)
    assert set(choices) == set(LAYERS)
    for c in choices.values():
        assert isinstance(c, KernelChoice) and c.repo and c.layer and c.variant and c.reason
    assert choices["RMSNorm"].variant.startswith("triton")
    assert choices["SiluAndMul"].variant.startswith("triton")


def test_tuned_variants_by_architecture():
    assert select("cuda", (8, 0))["RMSNorm"].variant == "triton-sm70"
    assert select("cuda", (8, 9))["RMSNorm"].variant == "triton-sm70"
    assert select("cuda", (9, 0))["RMSNorm"].variant == "triton-sm90"
    assert select("cuda", (9, 0))["SiluAndMul"].layer == "SiluAndMulTritonSm90"
    assert select("cuda", (7, 5))["SiluAndMul"].layer == "SiluAndMulTritonSm70"
    assert select("rocm", (9, 4))["RMSNorm"].variant == "triton-rocm"
    assert select("cpu", None)["RMSNorm"] == KernelChoice(
        "kernels_local/rmsnorm", "RMSNormCpu", "cpp", select("cpu", None)["RMSNorm"].reason
    )
    assert select("cpu", None)["SiluAndMul"].layer == "SiluAndMulCpu"
    assert select("cuda", (6, 0))["RMSNorm"].layer == "RMSNorm"  # below sm_70: the torch reference


@pytest.mark.parametrize("cap", [(10, 0), (12, 0), (15, 9)])
def test_beyond_tuned_ranges_is_a_defined_choice(cap):
    choices = select("cuda", cap)
    assert choices["RMSNorm"].variant == "triton-sm90"
    assert "newer than the newest tuned architecture" in choices["RMSNorm"].reason
    assert choices["Fp8Linear"].variant.startswith("native_e4m3")


def test_below_sm70_falls_back_to_torch():
    choices = select("cuda", (6, 1))
    assert choices["RMSNorm"].variant == "torch" and choices["SiluAndMul"].variant == "torch"
    assert choices["Fp8Linear"].variant == "emulated-torch"


@pytest.mark.parametrize(
    "device_type,caps", [("cuda", CUDA_CAPS + [(3, 5), (6, 0), (6, 1)]), ("rocm", ROCM_CAPS), ("cpu", [None])]
)
def test_fp8_variant_follows_the_fp8_convention(device_type, caps):
    from workers.quant.fp8_convention import choose_fp8

    for cap in caps:
        conv, _ = choose_fp8(device_type, cap)
        choice = select(device_type, cap)["Fp8Linear"]
        assert choice.fp8 == conv.name and choice.variant.startswith(conv.name), (device_type, cap, choice)


def test_native_fp8_exactly_from_sm89():
    natives = [cap for cap in CUDA_CAPS if select("cuda", cap)["Fp8Linear"].variant.startswith("native")]
    assert min(natives) == (8, 9) and natives == [c for c in CUDA_CAPS if c >= (8, 9)]


@pytest.mark.parametrize("device_type,caps", [("cuda", CUDA_CAPS + [(6, 1)]), ("rocm", ROCM_CAPS)])
def test_select_agrees_with_kernels_own_resolution(device_type, caps):
    """`kernels` resolves a capability with `find_smallest_interval` over what we register;
    ask it directly (no `_find_capability`) and compare with `select`."""
    with use_kernel_mapping(kernel_mapping(), inherit_mapping=False):
        registered = _KERNEL_MAPPING.get()
        for cap in caps:
            chosen = select(device_type, cap)
            for layer in LAYERS:
                tree = registered[layer][device_type].repos_by_capability
                repo = tree.find_smallest_interval(cap[0] * 10 + cap[1])[Mode.FALLBACK]
                assert repo == chosen[layer].repository(), (layer, cap)


def test_select_is_pure_and_repeatable():
    a = select("cuda", (9, 0))
    select("cuda", (8, 0))
    assert select("cuda", (9, 0)) == a
    assert a["RMSNorm"].to_dict() == {
        "repo": "kernels_local/rmsnorm",
        "layer": "RMSNormTritonSm90",
        "variant": "triton-sm90",
        "reason": a["RMSNorm"].reason,
    }


def test_select_imports_no_torch():
    code = (
        "import sys; from kernels_local.mapping import select; select('cuda', (9, 0)); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize(
    "device_type,cap,match",
    [
        ("tpu", (1, 0), "Unsupported device type `tpu`"),
        ("cuda", None, "needs a capability"),
        ("rocm", (9,), "needs a capability"),
    ],
)
def test_bad_input_names_the_value(device_type, cap, match):
    with pytest.raises(ValueError, match=match):
        select(device_type, cap)


def test_every_mapped_layer_loads_through_kernels():
    for layer, per_device in kernel_mapping().items():
        for device, repo in per_device.items():
            cls = repo.load()
            assert cls.__name__ == repo.layer_name, (layer, device)


def test_range_helpers_declare_kernels_devices():
    """The table's capability ranges are `kernels`' own Device / CUDAProperties / ROCMProperties
    (built at import; checked here at run time), and the native fp8 entry starts at sm_89."""
    assert _cuda(80, 88) == Device(type="cuda", properties=CUDAProperties(min_capability=80, max_capability=88))
    assert _rocm(94, 99) == Device(type="rocm", properties=ROCMProperties(min_capability=94, max_capability=99))
    assert _cuda(89, 89) in kernel_mapping()["Fp8Linear"]
