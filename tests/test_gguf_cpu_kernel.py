"""The CPU's GGUF kernel (kernels_local/gguf_linear/cpu_gguf.cpp, cpu.py), built here as a worker builds it.

What must hold, for each type it decodes (Q8_0, Q4_0 from gguf-py's quantizer; Q4_K, Q5_K, Q6_K as
random blocks with finite and subnormal fp16 scales):
- its dequantization equals gguf-py's `dequantize` bit for bit;
- its GEMV (decode rows: 1 to `GEMV_MAX_M - 1`) and the matmul on dequantized panels it takes
  from `GEMV_MAX_M` rows on equal the float32 matmul on gguf-py's weights within fp32 rounding,
  with and without a bias, for float32 and bfloat16 rows, over one panel and several;
- a row's output does not depend on the rows beside it in the call, nor on the thread count;
- blocks of the wrong layout or an unknown type code are a named error, not a crash.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402

from kernels_local.gguf_linear import cpu  # noqa: E402
from kernels_local.gguf_linear.reference import BLOCKS  # noqa: E402
from tests.test_kernels_gguf_linear import QUANTIZED_BY_GGUF, _subnormal_scales, _weight  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu.KERNEL.load().available, reason="the C++ kernel does not build here")


def _reference(raw: torch.Tensor, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw.numpy(), T[name])))


@pytest.mark.parametrize("name", list(cpu.TYPES))
@pytest.mark.parametrize("subnormal", [False, True])
def test_the_dequantized_blocks_equal_gguf_pys(name, subnormal):
    if subnormal and name in QUANTIZED_BY_GGUF:
        pytest.skip("gguf-py's quantizer writes normal scales")
    qk, _ = BLOCKS[name]
    raw = _weight(name, 7, 3 * qk, seed=4)
    if subnormal:
        raw = torch.from_numpy(_subnormal_scales(raw.numpy().copy(), name))
    want = _reference(raw, name)
    got = cpu.dequantize(raw, name, 3 * qk)
    assert torch.isfinite(want).all() and got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("name", list(cpu.TYPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, cpu.GEMV_MAX_M - 1, cpu.GEMV_MAX_M])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_equals_the_float32_matmul_on_the_dequantized_weight(name, m, dtype):
    """N = 37 (no multiple of the threads' grain), K = four blocks of the type."""
    qk, _ = BLOCKS[name]
    k, n = 4 * qk, 37
    raw = _weight(name, n, k, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k + 3, generator=gen)[:, :k].to(dtype)  # rows apart in memory
    bias = torch.randn(n, generator=gen).to(dtype) if m % 2 else None
    got = cpu.gguf_linear_cpu(x, raw, name, bias)
    want = torch.nn.functional.linear(x.float(), _reference(raw, name), None if bias is None else bias.float())
    assert got.dtype == dtype and got.shape == (m, n)
    scale = float(want.abs().max())
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the output apart
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("name", list(cpu.TYPES))
def test_a_prompts_rows_go_through_panels_of_the_dequantized_weight(name):
    """`gguf_gemm` (from `GEMV_MAX_M` rows): 300 outputs are a whole panel of 256 and a partial one, each
    dequantized into the thread's buffer before its matmul; a second, smaller call reuses the buffer."""
    qk, _ = BLOCKS[name]
    k = 2 * qk
    gen = torch.Generator().manual_seed(5)
    for n, m in ((300, 20), (40, cpu.GEMV_MAX_M)):
        raw = _weight(name, n, k, seed=n)
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        got = cpu.KERNEL.module.gguf_gemm(x, raw, cpu.TYPES[name], bias)
        want = torch.nn.functional.linear(x, _reference(raw, name), bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("name", list(cpu.TYPES))
def test_a_rows_output_depends_neither_on_its_batch_mates_nor_on_the_threads(name):
    """The GEMV takes the rows four at a time with the same sums per row: row i of a 7-row call (a group
    of four, then of three) equals row i alone, bit for bit, on one thread as on two; 197 outputs are
    three whole chunks of the rows the threads take in turn (cpu_gguf.cpp `rows_in_turn`) and a partial
    one, every output written once."""
    qk, _ = BLOCKS[name]
    raw = _weight(name, 197, 2 * qk, seed=9)
    x = torch.randn(7, 2 * qk, generator=torch.Generator().manual_seed(9))
    together = cpu.KERNEL.module.gguf_gemv(x, raw, cpu.TYPES[name], None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([cpu.KERNEL.module.gguf_gemv(x[i : i + 1], raw, cpu.TYPES[name], None) for i in range(7)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)
    want = torch.nn.functional.linear(x, _reference(raw, name))
    torch.testing.assert_close(together, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_blocks_of_the_wrong_layout_or_type_are_named_errors():
    raw = _weight("Q4_K", 4, 256)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match=r"contiguous uint8 \[N, 144\] blocks expected for 256 inputs"):
        cpu.KERNEL.module.gguf_gemv(x, raw[:, :100].contiguous(), cpu.TYPES["Q4_K"], None)
    with pytest.raises(RuntimeError, match="type code 9 is none of 0..4"):
        cpu.KERNEL.module.gguf_gemv(x, raw, 9, None)
    with pytest.raises(RuntimeError, match="no whole number of blocks of 256"):
        cpu.KERNEL.module.gguf_dequantize(raw, cpu.TYPES["Q4_K"], 200)
    for op in (cpu.KERNEL.module.gguf_gemv, cpu.KERNEL.module.gguf_gemm):
        with pytest.raises(RuntimeError, match="float32 rows"):
            op(x.double(), raw, cpu.TYPES["Q4_K"], None)
    with pytest.raises(RuntimeError, match=r"gguf_gemm: contiguous uint8 \[N, 144\]"):
        cpu.KERNEL.module.gguf_gemm(x, raw[:, :100].contiguous(), cpu.TYPES["Q4_K"], None)


def test_a_compiled_graph_calls_the_cpp_operator_itself():
    """Guards `fakes=` on cpu.py's `KERNEL` (kernels_local/cpp_build.py `register_fakes`) and the CPU
    key of cpu_gguf.cpp's `TORCH_LIBRARY_IMPL`: Dynamo traces `gguf_linear_cpu` into one call of
    `hetserve_cpu::gguf_linear` (no Python custom op around it), [B, S, K] rows keep their shape,
    and the compiled result is the eager one."""
    from torch._dynamo.testing import CompileCounterWithBackend

    raw = _weight("Q4_K", 40, 256, seed=3)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(3))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda t: cpu.gguf_linear_cpu(t * 2, raw, "Q4_K", None), backend=counter, fullgraph=True)
    got = compiled(x)
    assert got.shape == (2, 3, 40) and torch.equal(got, cpu.gguf_linear_cpu(x * 2, raw, "Q4_K", None))
    (graph,) = counter.graphs
    assert "hetserve_cpu.gguf_linear" in str(graph.code) and "hetserve.gguf_linear_cpu" not in str(graph.code)
