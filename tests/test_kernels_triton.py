"""Every Triton kernel against its torch reference, on CPU under `TRITON_INTERPRET=1`.

Triton decides at decoration time whether a `@triton.jit` function is compiled or
interpreted, and that includes its own standard library (`tl.sum`, `tl.sigmoid`), created
when `triton.language` is first imported. So the variable must be set before triton is
imported at all. When this process already imported triton in compiled mode (the whole
suite in one process), `test_kernels_run_under_the_interpreter` runs this file again in a
child pytest with `TRITON_INTERPRET=1`, and the kernel tests here skip; in the child (or
when the suite itself runs with the variable set) they run. Either way they run once.

Shapes stay small (the interpreter costs about 1 ms per program instance) and include
widths that are not powers of two, so every masked edge is exercised. fp16 results are
compared exactly where the kernel mirrors the reference's rounding; bf16 uses
`assert_close`'s defaults because the interpreter converts fp32 to bf16 by truncation
where torch rounds to nearest (one bf16 ulp). fp8 operands are put on the e4m3 grid in
torch before the kernel, so the interpreter's inexact fp32 -> fp8 cast never runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl

from workers.fp8.convention import EMULATED_E4M3, EMULATED_E4M3_FNUZ, NATIVE_E4M3, NATIVE_E4M3_FNUZ
from workers.fp8.e4m3 import decode_e4m3
from workers.fp8.quantize import quantize_weight_per_channel

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = type(tl.sum).__name__ == "InterpretedFunction"
needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child (test_kernels_run_under_the_interpreter)"
)


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-x"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]


@pytest.fixture(scope="module")
def interp():
    import kernels_local.activation
    import kernels_local.fp8_linear
    import kernels_local.paged_attention
    import kernels_local.rmsnorm

    mods = {
        "rmsnorm": kernels_local.rmsnorm,
        "activation": kernels_local.activation,
        "fp8_linear": kernels_local.fp8_linear,
        "paged_attention": kernels_local.paged_attention,
    }
    for repo, mod in mods.items():
        assert mod.runs_triton(torch.empty(1)), f"{repo} was not created under the interpreter"
    return mods


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ROW_SHAPES = [(1, 64), (3, 96), (2, 5, 200), (17, 48), (4, 1000)]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(actual, expected)


# -- RMSNorm -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
@needs_interpreter
def test_rms_norm_matches_reference(interp, shape, dtype):
    m = interp["rmsnorm"]
    gen = torch.Generator().manual_seed(hash(shape) % 1000)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    ref = m.rms_norm_reference(x, w, 1e-6)
    for tuning in m.TUNINGS.values():
        y = m.rms_norm(x, w, 1e-6, tuning)
        assert y.shape == x.shape and y.dtype == ref.dtype
        if dtype == torch.float16:
            torch.testing.assert_close(y, ref, rtol=0, atol=0)
        else:
            _close(y, ref)


@needs_interpreter
def test_rms_norm_fp32_weight_and_strided_input(interp):
    m = interp["rmsnorm"]
    x = torch.randn(6, 2 * 72, dtype=torch.bfloat16)[:, ::2]  # [6, 72], stride 2 along the row
    w = torch.randn(72)  # fp32 weight: output promotes to fp32, like the reference
    ref = m.rms_norm_reference(x, w, 1e-5)
    y = m.rms_norm(x, w, 1e-5, m.TUNINGS["sm90"])
    assert y.dtype == torch.float32
    # h is rounded to bf16 before the fp32 weight multiply: bf16 tolerance
    torch.testing.assert_close(y, ref, rtol=1.6e-2, atol=1e-5)


# -- SiluAndMul --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (3, 96), (2, 5, 200), (2, 1500)], ids=str)
@needs_interpreter
def test_silu_and_mul_matches_reference(interp, shape, dtype):
    m = interp["activation"]
    gen = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 4).to(dtype)
    ref = m.silu_and_mul_reference(x)
    for tuning in m.TUNINGS.values():
        y = m.silu_and_mul(x, tuning)
        assert y.shape == ref.shape and y.dtype == dtype
        _close(y, ref)


@needs_interpreter
def test_silu_and_mul_rejects_odd_width(interp):
    with pytest.raises(ValueError, match="even last dimension, got `7`"):
        interp["activation"].silu_and_mul(torch.randn(2, 7))


# -- fp8 linear ----------------------------------------------------------------------------

CONVENTIONS = {
    "e4m3fn": (NATIVE_E4M3, EMULATED_E4M3),
    "e4m3fnuz": (NATIVE_E4M3_FNUZ, EMULATED_E4M3_FNUZ),
}
GEMM_SHAPES = [(1, 48, 96), (5, 40, 72), (33, 24, 64)]  # (M, N, K): tails in every dim


def _quantized_weight(n: int, k: int, fmt: str, seed: int):
    native, emulated = CONVENTIONS[fmt]
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q_native, scale = quantize_weight_per_channel(w, native)
    q_emulated, scale_e = quantize_weight_per_channel(w, emulated)
    assert torch.equal(q_native.view(torch.uint8), q_emulated) and torch.equal(scale, scale_e)
    return q_native, q_emulated, scale


@pytest.mark.parametrize("fmt", sorted(CONVENTIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mnk", GEMM_SHAPES, ids=str)
@needs_interpreter
def test_fp8_linear_native_and_emulated_match_reference(interp, mnk, dtype, fmt):
    m = interp["fp8_linear"]
    rows, n, k = mnk
    q_native, q_emulated, scale = _quantized_weight(n, k, fmt, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    bias = torch.randn(n).to(dtype) if rows % 2 else None
    ref = m.fp8_linear_reference(x, q_emulated, scale, bias, fmt)
    for tuning in m.TUNINGS.values():
        y_native = m.fp8_linear(x, q_native, scale, bias, native=True, fmt=fmt, tuning=tuning)
        y_emulated = m.fp8_linear(x, q_emulated, scale, bias, native=False, fmt=fmt, tuning=tuning)
        # same grid values, exact products, same tile order: the two flags give the same bits
        assert torch.equal(y_native, y_emulated), tuning.name
        _close(y_native, ref)


@pytest.mark.parametrize("fmt", sorted(CONVENTIONS))
@needs_interpreter
def test_fp8_decode_covers_every_byte(interp, fmt):
    """All finite e4m3 bytes (subnormals, max, both signs) through the emulated kernel's
    in-register decode: one-hot tokens read out each weight column."""
    m = interp["fp8_linear"]
    nan_bytes = {0x7F, 0xFF} if fmt == "e4m3fn" else {0x80}
    codes = torch.tensor(
        [b for b in range(256) if b not in nan_bytes] + [0] * len(nan_bytes), dtype=torch.uint8
    )
    q = codes.reshape(16, 16)  # [N, K]
    scale = torch.ones(16)
    x = torch.eye(16)  # token j is on the grid as `max` with scale 1/max: y[j, n] = max * w[n, j] / max
    y = m.fp8_linear(x, q, scale, None, native=False, fmt=fmt, tuning=m.TUNINGS["sm80"])
    max_value = CONVENTIONS[fmt][0].max_value
    x_scale = torch.ones(1) / max_value  # what the kernel's epilogue multiplies by
    expected = (decode_e4m3(q, fmt).t() * max_value) * x_scale
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    y_native = m.fp8_linear(x, q.view(CONVENTIONS[fmt][0].fp8_dtype), scale, None, native=True, fmt=fmt)
    assert torch.equal(y_native, y)


@needs_interpreter
def test_fp8_linear_refuses_a_buffer_of_the_other_convention(interp):
    m = interp["fp8_linear"]
    q_native, q_emulated, scale = _quantized_weight(16, 32, "e4m3fn", seed=0)
    x = torch.randn(2, 32)
    with pytest.raises(TypeError, match="buffer and kernel flag must come from the same convention"):
        m.fp8_linear(x, q_emulated, scale, None, native=True, fmt="e4m3fn")
    with pytest.raises(TypeError, match="dtype `torch.float8_e4m3fn`"):
        m.fp8_linear(x, q_native, scale, None, native=False, fmt="e4m3fn")


@pytest.mark.parametrize("fmt", sorted(CONVENTIONS))
@needs_interpreter
def test_fused_per_token_quantization_matches_the_torch_quantizer(interp, fmt):
    """The GPU path's one-kernel quantizer against `quantize_rows`, bit for bit: exact ties
    (round half to even), subnormals, the saturation point, zero rows, fp8 and fp16 outputs."""
    quant = interp["fp8_linear"].quant
    native = CONVENTIONS[fmt][0]
    grid = decode_e4m3(torch.arange(256, dtype=torch.uint8), fmt)
    grid = grid[torch.isfinite(grid) & (grid >= 0)].sort().values
    ties = (grid[:-1] + grid[1:]) / 2
    row = torch.cat([grid, ties, -ties])  # amax is the format's max: scale 1, x / scale == x
    rows = torch.stack([row, row * 3.7, torch.zeros_like(row), torch.randn(row.numel()) * 1e-3])
    rows = torch.cat([rows, torch.zeros(4, 3)], dim=1)  # width not a power of two
    want_grid, want_scale = quant.quantize_rows(rows, fmt)
    for out_dtype in (native.fp8_dtype, torch.float16):
        q, scale = quant.quantize_rows_triton(rows, fmt, out_dtype)
        assert q.dtype == out_dtype and torch.equal(scale, want_scale)
        assert torch.equal(q.to(torch.float32), want_grid)


# -- paged attention (decode) ------------------------------------------------------------------


def _per_row_attention(q: torch.Tensor, kv: torch.Tensor, tables: list[list[int]], lens: list[int], window=None,
                       softcap=None, scale=None) -> torch.Tensor:  # fmt: skip
    """Plain math in fp32, one row at a time: the window's positions read one by one through the
    block table, scores scaled, then soft-capped."""
    _, hkv, _, bs, d = kv.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    for n, (table, length) in enumerate(zip(tables, lens, strict=True)):
        pos = torch.arange(max(0, length - window) if window else 0, length)
        blocks = torch.tensor(table)[pos // bs]
        k = kv[0][:, blocks, pos % bs].float()  # [Hkv, L, D]
        v = kv[1][:, blocks, pos % bs].float()
        group = q.shape[1] // hkv
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, L, D]
        s = torch.einsum("hd,hld->hl", q[n].float(), k) * (d**-0.5 if scale is None else scale)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        out[n] = torch.einsum("hl,hld->hd", torch.softmax(s, dim=-1), v)
    return out


def _paged_rows(hq: int, hkv: int, d: int, bs: int, lens: list[int], dtype, device="cpu", q_scale: float = 1.0):
    """Query, pool and block tables scattered over a pool twice the size needed (plus a spare block)."""
    gen = torch.Generator().manual_seed(sum(lens) + d)
    per_row = [-(-n // bs) for n in lens]
    num_blocks = 2 * sum(per_row) + 1
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [ids[sum(per_row[:i]) : sum(per_row[: i + 1])] for i in range(len(lens))]
    kv = torch.randn(2, hkv, num_blocks, bs, d, generator=gen).to(device, dtype)
    q = (torch.randn(len(lens), hq, d, generator=gen) * q_scale).to(device, dtype)
    return q, kv, tables


def _decode_rows(tables, lens, bs, device="cpu"):
    from workers.kv.batch import ForwardBatch, SeqChunk

    chunks = [(SeqChunk(n - 1, 1, t), [0]) for n, t in zip(lens, tables, strict=True)]
    return ForwardBatch.build(chunks, bs, device).decode


def _tolerance(dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


PAGED_CASES = [  # (query heads, kv heads, head dim, block size, lengths, window, softcap, scale, q scale)
    (4, 2, 64, 16, [1, 17, 40], None, None, None, 1.0),  # GQA, a length of one, lengths across blocks
    (4, 1, 40, 4, [7, 13, 3, 21], None, None, None, 1.0),  # MQA, head dim not a power of two, small blocks
    (2, 2, 32, 8, [33], None, None, None, 1.0),  # MHA, one row
    (8, 2, 16, 1, [5, 9], None, None, None, 1.0),  # a block per position
    (4, 2, 256, 16, [1, 17, 40], None, 50.0, None, 12.0),  # head dim 256, Gemma 2's cap (biting), GQA
    (4, 2, 256, 8, [5, 30, 47], 16, None, 144**-0.5, 1.0),  # a window shorter than two rows, longer than one
    (2, 1, 64, 4, [9, 3, 1], 1, None, None, 1.0),  # a window of one: the query's own position
    (4, 1, 40, 4, [7, 21], 64, 30.0, None, 8.0),  # a window longer than every row, MQA, head dim 40
    (8, 2, 16, 1, [5, 12], 3, 1.0, 4.0, 1.0),  # scores far past the cap (exp(2x) would overflow)
    (2, 2, 256, 16, [33], 18, 50.0, 0.1, 8.0),  # everything at once, the window's start mid-block
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PAGED_CASES, ids=str)
@needs_interpreter
def test_paged_decode_matches_the_torch_paths(interp, case, dtype):
    """Guards `lo = max(seq_len - window, 0)`, the `softcap > 0` branch with `_tanh` and the
    `scale` argument in `_paged_decode_kernel`, on block tables scattered over the pool: every
    tuning against per-row plain math (fp32 scores, as the kernel), `paged_decode_reference`
    against it too, the model's own `PagedAttention` (its options set) over a real
    `ForwardBatch` against the reference, and each kernel layer run as that module's forward
    (reading its attributes) against the kernel itself."""
    from workers.model.layers import PagedAttention

    m = interp["paged_attention"]
    hq, hkv, d, bs, lens, window, softcap, scale, q_scale = case
    options = {"window": window, "softcap": softcap, "scale": scale}
    q, kv, tables = _paged_rows(hq, hkv, d, bs, lens, dtype, q_scale=q_scale)
    decode = _decode_rows(tables, lens, bs)
    rows = (decode.block_tables, decode.seq_lens, decode.max_len)
    expected = _per_row_attention(q, kv, tables, lens, **options)
    if any(options.values()):  # the options bite
        assert not torch.allclose(expected, _per_row_attention(q, kv, tables, lens), atol=1e-3)
    # the torch path's own semantics in fp32 (in bf16 it rounds the scores before the cap, as the model does)
    torch.testing.assert_close(m.paged_decode_reference(q.float(), kv.float(), *rows, **options), expected,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    torch_path = m.paged_decode_reference(q, kv, *rows, **options)
    model = PagedAttention()
    model.sliding_window, model.softcap, model.scale = window, softcap, scale
    torch.testing.assert_close(model(q, kv, decode), torch_path)
    layers = {"sm70": m.layers.PagedAttentionTritonSm70, "sm90": m.layers.PagedAttentionTritonSm90,
              "rocm": m.layers.PagedAttentionTritonRocm}  # fmt: skip
    for name, tuning in m.TUNINGS.items():
        out = m.paged_decode(q, kv, *rows, tuning, **options)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, **_tolerance(dtype))
        assert torch.equal(layers[name].forward(model, q, kv, decode), out), name


def _poison_before_window(kv: torch.Tensor, tables: list[list[int]], lens: list[int], window: int) -> torch.Tensor:
    """A copy of the pool with NaN at every position before each row's window (one indexed store)."""
    bs = kv.shape[3]
    where = [(t[p // bs], p % bs) for t, n in zip(tables, lens, strict=True) for p in range(max(0, n - window))]
    poisoned = kv.clone()
    if where:
        blocks, offsets = torch.tensor(where, device=kv.device).unbind(1)
        poisoned[:, :, blocks, offsets] = float("nan")
    return poisoned


@pytest.mark.parametrize("window", [1, 6, 13])
@needs_interpreter
def test_paged_decode_never_reads_a_position_before_the_window(interp, window):
    """Guards `for start in range(lo, seq_len, TILE)` in `_paged_decode_kernel`: positions before
    a row's window are never loaded, so the cache may free their blocks. Here every such
    position holds NaN and the table entries of wholly out-of-window blocks point at a NaN
    block: the output stays finite and bit-identical to the clean pool's."""
    m = interp["paged_attention"]
    hq, hkv, d, bs, lens = 4, 2, 64, 4, [30, 13, 9, 2]
    q, kv, tables = _paged_rows(hq, hkv, d, bs, lens, torch.float32)
    clean = _decode_rows(tables, lens, bs)
    poisoned, moved = _poison_before_window(kv, tables, lens, window), [list(t) for t in tables]
    used = {b for t in tables for b in t}
    spare = next(b for b in range(kv.shape[2]) if b not in used)  # a block no row owns
    poisoned[:, :, spare] = float("nan")
    for row, length in enumerate(lens):
        for j in range(max(0, length - window) // bs):  # blocks wholly before the window
            moved[row][j] = spare
    decode = _decode_rows(moved, lens, bs)
    expected = _per_row_attention(q, kv, tables, lens, window=window)
    for tuning in m.TUNINGS.values():
        out = m.paged_decode(q, poisoned, decode.block_tables, decode.seq_lens, decode.max_len, tuning, window=window)
        assert torch.isfinite(out).all(), tuning.name
        want = m.paged_decode(q, kv, clean.block_tables, clean.seq_lens, clean.max_len, tuning, window=window)
        assert torch.equal(out, want), tuning.name
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_paged_decode_layers_run_the_kernel_and_refuse_odd_groups(interp):
    m = interp["paged_attention"]
    kv = torch.randn(2, 2, 4, 4, 8)
    with pytest.raises(ValueError, match="Query heads `3` must be a multiple of the KV heads `2`"):
        m.paged_decode(torch.randn(1, 3, 8), kv, torch.tensor([[0]]), torch.tensor([2]), 2)


@pytest.mark.parametrize("option,value,message", [("window", -1, "Sliding window `-1` is negative"),
                                                  ("softcap", -50.0, "Softcap `-50.0` is negative")])  # fmt: skip
@needs_interpreter
def test_paged_decode_refuses_negative_options(interp, option, value, message):
    """Guards `_kernel_options`: a negative window or cap would silently read as "off" in the kernel."""
    m = interp["paged_attention"]
    with pytest.raises(ValueError, match=f"{message}. Allowed: None or 0"):
        m.paged_decode(torch.randn(1, 2, 8), torch.randn(2, 2, 4, 4, 8), torch.tensor([[0]]), torch.tensor([2]), 2,
                       **{option: value})  # fmt: skip


# -- the compiled kernel (gpu_check.sh runs these on a real GPU; the interpreter runs them small) ----


def _against_reference(m, device: str, dtype, case, options: dict) -> None:
    """Every tuning of `paged_decode` on `device` against `paged_decode_reference` computed in
    fp32 from the same inputs (the kernel's scores are fp32); with a window, also on a pool
    whose out-of-window positions are NaN."""
    hq, hkv, d, bs, lens = case
    q, kv, tables = _paged_rows(hq, hkv, d, bs, lens, dtype, device, q_scale=4.0)
    decode = _decode_rows(tables, lens, bs, device)
    rows = (decode.block_tables, decode.seq_lens, decode.max_len)
    want = m.paged_decode_reference(q.float(), kv.float(), *rows, **options)
    poisoned = _poison_before_window(kv, tables, lens, options["window"]) if options["window"] else None
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for tuning in m.TUNINGS.values():
        out = m.paged_decode(q, kv, *rows, tuning, **options)
        assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
        torch.testing.assert_close(out.float(), want, **tol, msg=lambda e, t=tuning: f"{t.name} {options}: {e}")
        if poisoned is not None:
            assert torch.equal(m.paged_decode(q, poisoned, *rows, tuning, **options), out), (tuning.name, options)


COMPILED_OPTIONS = [  # (window, softcap, scale): full; Gemma 2 (cap 50, scale 1/sqrt(256) or 1/sqrt(144)); windows
    (None, None, None),
    (None, 50.0, 256**-0.5),
    (100, 50.0, 144**-0.5),  # shorter than most rows
    (1, None, None),
    (1024, None, None),  # Gemma 3's window: shorter than the longest row only
    (4096, 50.0, 256**-0.5),  # Gemma 2's window, longer than every row
]
COMPILED_SHAPES = [  # (query heads, kv heads, head dim, block size, lengths)
    (16, 8, 256, 16, [1, 15, 16, 17, 200, 333, 1030]),  # Gemma 2 9B
    (32, 16, 128, 16, [1, 15, 16, 17, 200, 333, 1030]),  # Gemma 2 27B
    (8, 4, 256, 32, [3, 64, 65, 700]),  # Gemma 3 4B, 32-position blocks
]


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1: the kernel is interpreted, not compiled")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_paged_decode_with_layer_options_matches_the_reference_on_cuda(dtype):
    """The compiled kernel on the GPU (every tuning, Gemma-shaped rows) against the torch
    reference for each window / softcap / scale variant, and never reading out-of-window blocks."""
    import kernels_local.paged_attention as m

    assert m.runs_triton(torch.empty(1, device="cuda"))
    for case in COMPILED_SHAPES:
        for window, softcap, scale in COMPILED_OPTIONS:
            _against_reference(m, "cuda", dtype, case, {"window": window, "softcap": softcap, "scale": scale})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@needs_interpreter
def test_the_compiled_check_runs_small_under_the_interpreter(interp, dtype):
    """The GPU test's own check, on small rows under the interpreter, so it is known to pass
    where the kernel is right before a GPU ever runs it."""
    for window, softcap, scale in COMPILED_OPTIONS:
        _against_reference(interp["paged_attention"], "cpu", dtype, (2, 1, 256, 16, [1, 17, 130]),
                           {"window": window, "softcap": softcap, "scale": scale})  # fmt: skip
