"""The start-up self-test: the kernelized model's forward against the same model's torch
reference path. On CPU the kernel layers of a simulated device run their torch paths, so
a sabotaged layer stands in for a miscompiled kernel; on a real GPU (`gpu` marker) the real
Triton kernels are compared, fp8 included."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernelize import device, tiny_model
from workers.engine.metrics import WorkerMetrics
from workers.kernelize.apply import kernelize_for_device
from workers.kernelize.selftest import (
    TOLERANCE,
    SelfTestError,
    compare_with_reference,
    reference_path,
    self_test,
    self_test_or_fall_back,
)
from workers.model.layers import PagedAttention, RMSNorm


def test_kernelized_model_agrees_with_its_reference_path():
    model = tiny_model()
    kernelize_for_device(model, device("sm_90"))
    result = self_test(model, model.config, "cpu")
    assert result.ok and result.swapped == 2 * 2 + 1 + 2 + 2  # norms + activations + paged attention of the tiny model
    assert result.max_abs_error == 0.0 and result.shape == (2, 16, model.config.vocab_size)
    assert result.tolerance == TOLERANCE[torch.float32]


def test_a_wrong_kernel_fails_the_self_test_with_its_figures():
    """Guards the comparison in `self_test`: a layer that computes something else than its
    reference (here a norm off by 10%) must stop the worker, with the error figures."""
    model = tiny_model()
    kernelize_for_device(model, device("sm_90"))
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    kernel = norm.forward
    norm.forward = lambda x: kernel(x) * 1.1
    with pytest.raises(SelfTestError, match=r"max \|kernel - reference\| = [\d.e-]+, [\d.]+% of max \|logit\|"
                                            r" [\d.e-]+ \(tolerance 0\.1%\)"):
        self_test(model, model.config, "cpu")


def test_a_wrong_decode_attention_kernel_fails_the_self_test():
    """Guards the paged decode step in `compare_with_reference`: the full forward never runs
    `PagedAttention`, so a decode attention kernel off by 10% must be caught by that step."""
    model = tiny_model()
    kernelize_for_device(model, device("sm_90"))
    for m in model.modules():
        if isinstance(m, PagedAttention):
            kernel = m.forward
            m.forward = lambda q, kv, decode, kernel=kernel: kernel(q, kv, decode) * 1.1
    result = compare_with_reference(model, model.config.vocab_size, "cpu")
    assert not result.ok and result.relative_error > 10 * result.tolerance


def test_reference_path_restores_every_kernel_forward():
    model = tiny_model()
    kernelize_for_device(model, device("sm_80"))
    before = {m: m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__}
    with reference_path(model) as swapped:
        assert swapped == len(before) and all("forward" not in m.__dict__ for m in before)
    assert {m: m.__dict__["forward"] for m in before} == before


def test_nan_from_a_kernel_is_a_failure():
    model = tiny_model()
    kernelize_for_device(model, device("sm_90"))
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    norm.forward = lambda x: x * float("nan")
    assert not compare_with_reference(model, model.config.vocab_size, "cpu").ok


def test_a_wrong_kernel_goes_back_to_its_torch_path_and_the_others_stay():
    """Guards `to_torch_path(model, layer)` in `self_test_or_fall_back`: a norm kernel off by 10%
    is replaced by its torch path, with the figures as the reason; the activation and attention
    kernels keep theirs, and the model then agrees with its reference exactly."""
    model = tiny_model()
    kernelize_for_device(model, device("sm_90"))
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    kernel = norm.forward
    norm.forward = lambda x: kernel(x) * 1.1
    result, failed = self_test_or_fall_back(model, model.config, "cpu")
    assert list(failed) == ["RMSNorm"] and "its self-test failed on this device" in failed["RMSNorm"]
    assert result.ok and result.max_abs_error == 0.0
    assert all("forward" not in m.__dict__ for m in model.modules() if isinstance(m, RMSNorm))
    assert any("forward" in m.__dict__ for m in model.modules() if isinstance(m, PagedAttention))
    metrics = WorkerMetrics()
    metrics.fell_back(failed)  # what workers/main.py hands the worker's metrics
    text = metrics.render().decode()
    assert 'hetserve_worker_kernel_fallback{layer="RMSNorm",reason="' in text, text


def test_a_kernel_that_raises_goes_back_to_its_torch_path():
    """A decode attention kernel that raises on the device (as a failing compile does) takes the
    whole-model test down; the kernel-by-kernel pass names it and the worker serves on."""
    model = tiny_model()
    kernelize_for_device(model, device("sm_90"))

    def broken(q, kv, decode):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    for m in model.modules():
        if isinstance(m, PagedAttention):
            m.forward = broken
    result, failed = self_test_or_fall_back(model, model.config, "cpu")
    assert list(failed) == ["PagedAttention"] and "no kernel image" in failed["PagedAttention"]
    assert result.ok


def test_a_model_whose_torch_path_fails_still_refuses_to_start():
    """Only when the torch path itself fails (here it gives NaN: no kernel can agree with it, and
    with every kernel out the model still does not answer) does the worker refuse."""
    model = tiny_model()
    kernelize_for_device(model, device("sm_90"))
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    kernel = norm.forward  # the kernel forward stays right; the class (torch) forward goes wrong
    norm.forward = kernel
    original = type(norm).forward
    try:
        type(norm).forward = lambda self, x: original(self, x) * float("nan")
        with pytest.raises(SelfTestError, match="even with the failing kernels"):
            self_test_or_fall_back(model, model.config, "cpu")
    finally:
        type(norm).forward = original


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [False, True])
def test_self_test_on_the_real_gpu(quantize):
    """The embedded model on the real device, kernelized for it (and fp8-quantized in its
    convention): the Triton kernels agree with the torch path within the tolerance."""
    from tests.process_state import unlock_fp8
    from workers.contract import DEFAULT_MODEL_DIR
    from workers.device.bind import bind_device
    from workers.model.loader import load_model
    from workers.quant.fp8_convention import choose_fp8
    from workers.quant.quantize_model import quantize_model

    bound = bind_device()
    loaded = load_model(DEFAULT_MODEL_DIR, "auto", bound.torch_device, bound.capability)
    kernelize_for_device(loaded.model, bound)
    if quantize:
        unlock_fp8()
        quantize_model(loaded.model, choose_fp8(bound.type, bound.capability)[0])
    result = self_test(loaded.model, loaded.config, bound.torch_device)
    print(result)
    assert result.ok and result.swapped > 0
