"""The 4-bit run-time layout (workers/quant/int4_linear.py): every format moved into it exactly, the layer's
reference forward, the W4A16 kernel layers run on it, and its bytes.

What must hold:
- GPTQ (v1 and v2 zero points, act-order, per channel), AWQ and pack-quantized (with and without zero
  points) in the run-time layout dequantize to the format's reference weight bit for bit, by our
  unpacking and by the kernel repository's reference;
- `Int4CheckpointLinear.forward` is the reference weight's linear in fp32, cast;
- under `TRITON_INTERPRET=1` (this file reruns itself) each Triton layer on the module equals its
  forward within fp32 rounding;
- the layer holds at most 0.3x the bytes of the same weight in bf16 at groups of 32 and 128.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels_local.int4_linear import layers, unpack_weight
from tests.int4_checkpoints import awq_tensors, gptq_tensors, pack_quantized_tensors
from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter
from workers.quant.int4_linear import Int4CheckpointLinear, runtime_weight, to_runtime
from workers.quant.int4_scheme import Int4Scheme

OUT, IN = 48, 128


def _case(name: str, seed: int = 0):
    """(scheme, stored tensors, reference weight [OUT, IN]) of one format case."""
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed)) * 0.1
    if name == "gptq-v1":
        t, ref = gptq_tensors(w, 32, True, "gptq")
        return Int4Scheme("gptq", 32, True, zero_offset=1), t, ref
    if name == "gptq-v2-actorder":
        t, ref = gptq_tensors(w, 64, False, "gptq_v2", desc_act=True, dtype=torch.bfloat16)
        return Int4Scheme("gptq", 64, False, desc_act=True), t, ref
    if name == "gptq-per-channel":
        t, ref = gptq_tensors(w, -1, False, "gptq_v2")
        return Int4Scheme("gptq", -1, False), t, ref
    if name == "awq":
        t, ref = awq_tensors(w, 32)
        return Int4Scheme("awq", 32, False), t, ref
    if name == "ct-sym":
        t, ref = pack_quantized_tensors(w, 32, True)
        return Int4Scheme("pack-quantized", 32, True, zero_points=False), t, ref
    t, ref = pack_quantized_tensors(w, -1, False)
    return Int4Scheme("pack-quantized", -1, False), t, ref


CASES = ("gptq-v1", "gptq-v2-actorder", "gptq-per-channel", "awq", "ct-sym", "ct-asym-per-channel")


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


@pytest.mark.parametrize("name", CASES)
def test_every_format_moves_into_the_runtime_layout_exactly(name):
    scheme, stored, ref = _case(name)
    rt = to_runtime(scheme, stored)
    assert rt["qweight"].shape == (IN // 8, OUT) and rt["zeros"].dtype == torch.int8
    assert (rt["g_idx"] is not None) == (name == "gptq-v2-actorder")  # a trivial g_idx is dropped
    args = (rt["qweight"], rt["scales"], rt["zeros"], rt["g_idx"], rt["group_size"], rt["in_features"])
    assert torch.equal(runtime_weight(*args), ref)
    assert torch.equal(unpack_weight(*args), ref)  # the kernel repository reads the same weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CASES)
def test_the_layers_forward_is_the_reference_weights_linear(name, dtype):
    scheme, stored, ref = _case(name)
    bias = torch.randn(OUT).to(dtype)
    layer = Int4CheckpointLinear.from_runtime(to_runtime(scheme, stored), bias)
    x = torch.randn(3, 5, IN).to(dtype)
    want = F.linear(x.float(), ref.to(dtype).float(), bias.float()).to(dtype)
    torch.testing.assert_close(layer(x), want, rtol=1e-6, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("layer_name", list(layers.COMPILE_SPECS))
@pytest.mark.parametrize("name", ["gptq-v2-actorder", "awq", "ct-asym-per-channel"])
def test_each_triton_layer_on_the_module_equals_its_forward(name, layer_name):
    scheme, stored, _ = _case(name)
    module = Int4CheckpointLinear.from_runtime(to_runtime(scheme, stored), torch.randn(OUT), execution="w4a16")
    x = torch.randn(7, IN)
    got = getattr(layers, layer_name).forward(module, x)
    torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-5)
    module.execution = "packed"  # a module loaded for the CPU's execution is refused by a Triton layer
    with pytest.raises(TypeError, match="`w4a16` execution got a module loaded for `packed`"):
        getattr(layers, layer_name).forward(module, x)


@pytest.mark.parametrize("group", [32, 128])
def test_the_layer_holds_at_most_0_3x_the_bf16_bytes(group):
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(3)) * 0.1
    t, _ = gptq_tensors(w, group, False, "gptq_v2")
    layer = Int4CheckpointLinear.from_runtime(to_runtime(Int4Scheme("gptq", group, False), t))
    assert layer.nbytes() <= 0.3 * w.numel() * 2


@pytest.mark.parametrize("group", [32, 64, 0])
def test_the_broadcast_unpack_of_whole_groups_equals_the_per_input_gather(group):
    """`runtime_weight` and `unpack_weight` broadcast each group's zero point and scale when the groups
    tile the inputs (no act-order); an explicit `g_idx` of k // group takes the gather path: same bits."""
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(5)) * 0.1
    t, ref = gptq_tensors(w, group or -1, False, "gptq_v2", dtype=torch.bfloat16)
    rt = to_runtime(Int4Scheme("gptq", group or -1, False), t)
    assert rt["g_idx"] is None
    explicit = (torch.arange(128) // (group or 128)).to(torch.int32)
    for unpack in (runtime_weight, unpack_weight):
        fast = unpack(rt["qweight"], rt["scales"], rt["zeros"], None, rt["group_size"], 128)
        gathered = unpack(rt["qweight"], rt["scales"], rt["zeros"], explicit, rt["group_size"], 128)
        assert torch.equal(fast, gathered) and torch.equal(fast, ref)
