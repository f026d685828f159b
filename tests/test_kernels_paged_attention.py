"""The paged-decode Triton kernel against its torch paths, on CPU under `TRITON_INTERPRET=1`
(tests/interpreter.py: this file reruns itself in a child with it), and compiled on a GPU
when `scripts/gpu_check.sh` runs where one is lent.

Block tables are scattered over the pool; the options of the 2026 families are covered one
by one and together: head dim 256, Gemma's soft-cap and scale, sliding windows (never reading
a position before the window), gpt-oss's per-head sinks, and Gemma 4's global layers (head dim
512, one KV head for eight query heads, unscaled scores).
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


@pytest.fixture(scope="module")
def interp():
    import kernels_local.paged_attention

    assert kernels_local.paged_attention.runs_triton(torch.empty(1)), "not created under the interpreter"
    return {"paged_attention": kernels_local.paged_attention}


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
    (8, 1, 512, 8, [1, 40], 16, None, 1.0, 0.05),  # Gemma 4's global layer: head dim 512 (more warps pre-Hopper),
    # eight query heads to its one KV head, unscaled scores; a window to cover it too
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
    (32, 4, 512, 16, [1, 15, 16, 17, 200, 333, 1030]),  # Gemma 4 31B's global layers
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
    where the kernel is right before a GPU ever runs it (head dim 512 once, with its options).
    bfloat16 takes two of the option sets, no window, cap or scale and a window with a cap and a
    scale: its loads, stores and rounding are the dtype's own, the loop over blocks and the masks
    are fp32's and fp16's, and the interpreter emulates bfloat16 at several times their cost."""
    options = COMPILED_OPTIONS if dtype != torch.bfloat16 else COMPILED_OPTIONS[:1] + COMPILED_OPTIONS[2:3]
    for window, softcap, scale in options:
        _against_reference(interp["paged_attention"], "cpu", dtype, (2, 1, 256, 16, [1, 17, 130]),
                           {"window": window, "softcap": softcap, "scale": scale})  # fmt: skip
    _against_reference(interp["paged_attention"], "cpu", dtype, (2, 1, 512, 16, [1, 40]),
                       {"window": 16, "softcap": None, "scale": 512**-0.5})


# -- gpt-oss's sinks ----------------------------------------------------------------------------


def _with_sinks(q, kv, tables, lens, sinks, window=None) -> torch.Tensor:
    """Plain math with a sink per query head: one more logit in each softmax, its weight dropped."""
    _, hkv, _, bs, d = kv.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    for n, (table, length) in enumerate(zip(tables, lens, strict=True)):
        pos = torch.arange(max(0, length - window) if window else 0, length)
        blocks = torch.tensor(table)[pos // bs]
        k, v = (kv[i][:, blocks, pos % bs].float().repeat_interleave(q.shape[1] // hkv, 0) for i in (0, 1))
        s = torch.einsum("hd,hld->hl", q[n].float(), k) * d**-0.5  # [Hq, L]
        p = torch.softmax(torch.cat((s, sinks.float()[:, None]), dim=-1), dim=-1)[:, :-1]
        out[n] = torch.einsum("hl,hld->hd", p, v)
    return out


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@needs_interpreter
def test_paged_decode_with_sinks_matches_plain_math(interp, dtype, window):
    """Guards the sink's start of the running max and sum in `_paged_decode_kernel` (`sink`,
    `use_sinks`): every tuning, the torch reference and the model's `PagedAttention` holding
    `sinks` give softmax over the scores and one logit per head, whose weight is dropped. One
    head's sink dominates (its row shrinks towards 0), one is far below (no effect)."""
    from workers.model.layers import PagedAttention

    m = interp["paged_attention"]
    hq, hkv, d, bs, lens = 4, 2, 64, 4, [1, 9, 30]
    q, kv, tables = _paged_rows(hq, hkv, d, bs, lens, dtype)
    sinks = torch.tensor([0.5, 8.0, -30.0, -1.0])
    decode = _decode_rows(tables, lens, bs)
    rows = (decode.block_tables, decode.seq_lens, decode.max_len)
    expected = _with_sinks(q, kv, tables, lens, sinks, window)
    plain = _per_row_attention(q, kv, tables, lens, window=window)
    assert not torch.allclose(expected[:, 1], plain[:, 1], atol=1e-2)  # the large sink bites
    torch.testing.assert_close(expected[:, 2], plain[:, 2], rtol=1e-5, atol=1e-5)  # the tiny one does not
    model = PagedAttention()
    model.sliding_window, model.softcap, model.scale = window, None, None
    model.sinks = torch.nn.Parameter(sinks.to(dtype), requires_grad=False)
    torch.testing.assert_close(model(q, kv, decode).float(), expected, **_tolerance(dtype))
    torch.testing.assert_close(m.paged_decode_reference(q, kv, *rows, window=window, sinks=model.sinks).float(),
                               expected, **_tolerance(dtype))  # fmt: skip
    for tuning in m.TUNINGS.values():
        out = m.paged_decode(q, kv, *rows, tuning, window=window, sinks=model.sinks)
        torch.testing.assert_close(out.float(), expected, **_tolerance(dtype))
        assert not torch.equal(out, m.paged_decode(q, kv, *rows, tuning, window=window))  # the sinks were used
