"""The CPU's C++ elementwise kernels against their torch forms: RMSNorm (kernels_local/rmsnorm/cpu.py),
SiluAndMul (kernels_local/activation/cpu.py) and the rotary embedding (kernels_local/rotary/cpu.py);
which inputs take them, their switches and their errors.

The C++ sources are built on first use (about 6 s each, once per host, then cached by torch); without
a C++ compiler the tests that need a kernel skip with the reason its loader gives.
"""

from __future__ import annotations

import pytest
import torch

from kernels_local.activation import cpu as act_cpu
from kernels_local.activation.silu_and_mul import silu_and_mul_reference
from kernels_local.rmsnorm import cpu as norm_cpu
from kernels_local.rmsnorm.rmsnorm import rms_norm_reference
from kernels_local.rotary import cpu as cpu_rotary
from workers.model.rope import apply_rotary

DTYPES = [torch.float32, torch.bfloat16]


def _needs(kernel):
    state = kernel.load()
    if not state.available:
        pytest.skip(state.reason)


def _torch_rotary(x, cos, sin):
    """`apply_rotary`'s torch form, written out (partial rotary: the rest passes through)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2048, 256), (7, 96), (3, 5, 33), (1, 4096)])
def test_rms_norm_is_the_reference_within_the_variances_last_bit(dtype, shape):
    """A wide row, a row narrower than a vector, an odd width (a scalar tail) and 3-d input: bfloat16
    within one bfloat16 step of the reference (the sum of squares in the kernel's own order), float32
    within float32 rounding; the output keeps the input's shape and dtype."""
    _needs(norm_cpu.KERNEL)
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g).to(dtype)
    got, want = norm_cpu.rms_norm_cpu(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-6)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_rms_norm_reads_strided_rows_and_takes_the_reference_for_other_inputs():
    """Rows of a wider tensor (a slice: stride larger than the width) are read in place; a weight
    of another dtype (the reference promotes the output) and float16 take the reference."""
    _needs(norm_cpu.KERNEL)
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(9, 160, generator=g).to(torch.bfloat16)
    x, w = wide[:, 32:128], torch.randn(96, generator=g).to(torch.bfloat16)
    assert x.stride(0) == 160 and norm_cpu.runs_cpp(x, w)
    torch.testing.assert_close(norm_cpu.rms_norm_cpu(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), rtol=2 ** -7, atol=0)
    w32 = w.float()
    assert not norm_cpu.runs_cpp(x, w32) and norm_cpu.rms_norm_cpu(x, w32, 1e-6).dtype == torch.float32
    assert not norm_cpu.runs_cpp(x.half(), w.half())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2048, 1376), (7, 96), (3, 5, 66), (1, 2)])
def test_silu_and_mul_is_the_reference_bit_for_bit(dtype, shape):
    """The reference's math, rounding for rounding (SiLU rounded to bfloat16 before the product), with
    ATen's own vectorized `exp` in blocks of two vectors and `std::exp` for the rest of each row, as
    ATen's SiLU loop on one thread (on more, ATen splits the tensor at any element, which moves its
    scalar tails: the reference is taken on one)."""
    _needs(act_cpu.KERNEL)
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 4).to(dtype)
    got = act_cpu.silu_and_mul_cpu(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = silu_and_mul_reference(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, heads, dim, rot", [(2048, 6, 64, 64), (5, 3, 64, 32), (7, 2, 80, 80), (3, 4, 96, 24)])
def test_rotary_is_the_torch_form_bit_for_bit(dtype, tokens, heads, dim, rot):
    """Full and partial rotaries, head sizes that leave a vector tail, heads read in place from a
    wider projection (the q and k heads of a fused qkv): every product, difference and sum rounded
    as the torch form rounds them, so `apply_rotary` gives the same bits either way."""
    _needs(cpu_rotary.KERNEL)
    g = torch.Generator().manual_seed(tokens + dim)
    qkv = torch.randn(tokens, heads + 2, dim, generator=g).to(dtype)
    x = qkv[:, :heads]  # a view: row stride (heads + 2) * dim
    angles = torch.randn(tokens, 1, rot // 2, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert cpu_rotary.runs(x, cos)
    got = apply_rotary(x, cos, sin)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got, _torch_rotary(x, cos, sin))


def test_rotary_takes_the_torch_form_for_what_the_kernel_does_not_read():
    """Batched [B, S, heads, D] input (the parity forward) and cos of another dtype stay with the
    torch form."""
    x = torch.randn(2, 5, 3, 8)
    cos = torch.randn(5, 1, 4)
    assert not cpu_rotary.runs(x, cos)
    assert not cpu_rotary.runs(x[0], cos.double())
    torch.testing.assert_close(apply_rotary(x, cos, cos), _torch_rotary(x, cos, cos))


@pytest.mark.parametrize("module, runs", [(norm_cpu, lambda: norm_cpu.runs_cpp(torch.ones(2, 4), torch.ones(4))),
                                          (act_cpu, lambda: act_cpu.runs_cpp(torch.ones(2, 4))),
                                          (cpu_rotary,
                                           lambda: cpu_rotary.runs(torch.ones(2, 1, 4), torch.ones(2, 1, 2)))],
                         ids=["rmsnorm", "activation", "rotary"])
def test_under_torch_compile_every_kernel_leaves_the_torch_form_to_inductor(monkeypatch, module, runs):
    """Guards the `torch.compiler.is_compiling()` term of each `runs` check: the compiled decode step
    traces the torch form, which Inductor fuses (an opaque C++ call would stop that)."""
    _needs(module.KERNEL)
    assert runs()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not runs()


@pytest.mark.parametrize("module, env", [(norm_cpu, norm_cpu.ENV_CPU_RMSNORM), (act_cpu, act_cpu.ENV_CPU_ACTIVATION),
                                         (cpu_rotary, cpu_rotary.ENV_CPU_ROTARY)],
                         ids=["rmsnorm", "activation", "rotary"])
def test_the_switch_keeps_the_torch_form_and_says_so(monkeypatch, module, env):
    monkeypatch.setenv(env, "off")
    module.KERNEL.reset()
    try:
        state = module.KERNEL.load()
        assert not state.available and state.reason == f"${env}=off: the torch reference"
    finally:
        monkeypatch.delenv(env)
        module.KERNEL.reset()


def test_the_kernels_name_a_bad_input_and_what_they_accept():
    """Called directly with what the Python side never passes: an error naming the shapes or dtype."""
    _needs(norm_cpu.KERNEL)
    _needs(act_cpu.KERNEL)
    _needs(cpu_rotary.KERNEL)
    with pytest.raises(RuntimeError, match=r"weight of 4 values in Float expected"):
        norm_cpu.KERNEL.module.rms_norm(torch.ones(2, 4), torch.ones(3), 1e-6)
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16 expected, got Half"):
        act_cpu.KERNEL.module.silu_and_mul(torch.ones(2, 4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"rotary: cos and sin \[T, 1, R/2\]"):
        cpu_rotary.KERNEL.module.rotary(torch.ones(2, 1, 4), torch.ones(2, 1, 3), torch.ones(2, 1, 3))
