"""The gated delta rule's Triton kernels against their torch references, on CPU under
`TRITON_INTERPRET=1` (tests/interpreter.py: this file reruns itself in a child with it).

Operands are laid out as the model hands them over: q, k and v are column slices of one
packed projection (row stride wider than the heads), the state pool has more slots than the
step uses and its slots are scattered, head dims that are not powers of two (masked lanes),
two value heads per key head. Every tuning (pre-Hopper, Hopper, ROCm) runs: the one-step
decode kernel, the chunked prefill kernel over spans shorter than a chunk, exactly one chunk
and several (the last one padded), and the layers' forward over a step mixing decode rows and
prefill spans, against the model's torch `GatedDeltaRule`.
"""

from __future__ import annotations

import types

import pytest
import torch

from tests.interpreter import INTERPRETED, needs_interpreter, rerun_under_interpreter

HK, HV, DK, DV = 2, 4, 24, 20  # padded to 32 lanes each: the masks are exercised
SLOTS = 7


@pytest.mark.skipif(INTERPRETED, reason="already running under the interpreter")
def test_kernels_run_under_the_interpreter():
    rerun_under_interpreter(__file__)


@pytest.fixture(scope="module")
def gd():
    import kernels_local.gated_delta as gd

    assert gd.runs_triton(torch.empty(1)), "not created under the interpreter"
    return gd


def _operands(tokens: int, dtype=torch.float32, seed: int = 0):
    """q, k [T, Hk, Dk], v [T, Hv, Dv], beta [T, Hv] as views of one packed projection (as the model
    slices them), g [T, Hv] fp32 log decays <= 0, and a state pool [S, Hv, Dk, Dv] fp32 of non-zero states."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * HK * DK + HV * DV + HV + 5  # q | k | v | beta | 5 more columns: a row stride of its own
    packed = torch.randn(tokens, width, generator=gen).to(dtype)
    q = packed[:, : HK * DK].unflatten(-1, (HK, DK))
    k = packed[:, HK * DK : 2 * HK * DK].unflatten(-1, (HK, DK))
    v = packed[:, 2 * HK * DK : 2 * HK * DK + HV * DV].unflatten(-1, (HV, DV))
    beta = packed[:, 2 * HK * DK + HV * DV : 2 * HK * DK + HV * DV + HV].float().sigmoid().to(dtype)
    g = -torch.rand(tokens, HV, generator=gen) * 0.7
    state = torch.randn(SLOTS, HV, DK, DV, generator=gen) * 0.3
    return q, k, v, g, beta, state


def _tol(dtype) -> dict:
    return {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


@needs_interpreter
@pytest.mark.parametrize("tuning", ["sm70", "sm90", "rocm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_decode_kernel_steps_each_rows_slot_once(gd, tuning, dtype):
    q, k, v, g, beta, state = _operands(9, dtype)
    rows, slots = torch.tensor([0, 2, 3, 7, 8]), torch.tensor([5, 0, 3, 6, 1])  # a gather of rows, scattered slots
    want_state = state.clone()
    o, s = gd.step_reference(q[rows], k[rows], v[rows], g[rows], beta[rows], state.index_select(0, slots))
    want_state.index_copy_(0, slots, s)
    out = torch.zeros_like(v)
    gd.gated_delta_step(q, k, v, g, beta, state, rows, slots, out, gd.TUNINGS[tuning])
    torch.testing.assert_close(out[rows].float(), o.float(), **_tol(dtype))
    assert not out[[1, 4, 5, 6]].any()  # rows that are not decode rows are left alone
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)  # untouched slots (2, 4) bit for bit too


@needs_interpreter
@pytest.mark.parametrize("tuning", ["sm70", "sm90", "rocm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunk_kernel_carries_each_spans_state_over_its_chunks(gd, tuning, dtype):
    """Spans of 3, 16, 32 and 71 tokens: within one chunk, exactly one or two (the chunk of the
    tuning), and several with a padded last one; each from and back into its own slot."""
    spans = [(0, 3, 4), (3, 16, 0), (19, 32, 6), (51, 71, 2)]
    q, k, v, g, beta, state = _operands(122, dtype, seed=1)
    want_state, want = state.clone(), torch.zeros_like(v)
    for start, n, slot in spans:  # the recurrence token by token: what both forms compute
        s = want_state[slot : slot + 1]
        for t in range(start, start + n):
            o, s = gd.step_reference(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
            want[t] = o[0]
        want_state[slot] = s[0]
    out = torch.zeros_like(v)
    gd.gated_delta_chunks(q, k, v, g, beta, state, torch.tensor(spans), out, gd.TUNINGS[tuning])
    torch.testing.assert_close(out.float(), want.float(), **_tol(dtype))
    torch.testing.assert_close(state, want_state, atol=1e-4, rtol=1e-4)
    assert torch.equal(state[[1, 3, 5]], _operands(122, dtype, seed=1)[5][[1, 3, 5]])  # other slots untouched


@needs_interpreter
@pytest.mark.parametrize("layer", ["GatedDeltaRuleTritonSm70", "GatedDeltaRuleTritonSm90", "GatedDeltaRuleTritonRocm"])
def test_each_triton_layer_equals_the_models_torch_rule_on_a_mixed_step(gd, layer):
    """One step: two decode rows (rows 0 and 1), then prefill spans of 20 and 45 tokens, each with
    its slot, through the kernel layer and through the model's `GatedDeltaRule` (the reference)."""
    from workers.kv.batch import ForwardBatch, SeqChunk
    from workers.model.linear_attention import GatedDeltaRule

    plan = [(30, 1, 3), (12, 1, 0), (0, 20, 5), (8, 45, 1)]  # (start position, tokens, slot)
    chunks = [(SeqChunk(start, n, [0] * 32, state_slot=slot), [0] * n) for start, n, slot in plan]
    batch = ForwardBatch.build(chunks, 4)
    q, k, v, g, beta, state = _operands(67, seed=2)
    want_state = state.clone()
    want = GatedDeltaRule()(q, k, v, g, beta, want_state, batch)
    module = types.SimpleNamespace(token_by_token=False, chunk=64)
    got = getattr(gd.layers, layer).forward(module, q, k, v, g, beta, state, batch)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-4, rtol=1e-4)


def test_operands_that_do_not_fit_are_refused_naming_their_shapes():
    import kernels_local.gated_delta.gated_delta as mod

    q, k, v, g, beta, state = _operands(4)
    out, rows = torch.empty_like(v), torch.arange(4)
    with pytest.raises(ValueError, match=r"state `\(7, 4, 24, 20\)` torch.float16.*float32"):
        mod.gated_delta_step(q, k, v, g, beta, state.half(), rows, rows, out)
    with pytest.raises(ValueError, match=r"v `\(4, 3, 20\)`.*Hk dividing Hv"):
        mod.gated_delta_step(q, k, v[:, :3], g, beta, state[:, :3], rows, rows, out)
    with pytest.raises(ValueError, match="contiguous"):
        mod.gated_delta_step(q, k, v, g, beta, state.transpose(2, 3).contiguous().transpose(2, 3), rows, rows, out)


# -- the compiled kernels (on a real GPU; skipped without CUDA) --------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1: the kernels are interpreted, not compiled")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_kernels_match_the_references_on_cuda_at_qwen3_5_shapes(dtype):
    """Qwen3.5 / Qwen3-Next DeltaNet heads (16 key heads, 32 value heads, 128 each) on the GPU,
    every tuning: prefill spans of 1,000, 64, 17 and 2 tokens, then 8 decode rows on distinct
    slots, against the torch references in fp32 (the state fp32 throughout). A tf32 dot would
    miss the fp32 bound."""
    import kernels_local.gated_delta as gd

    hk, hv, d = 16, 32, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    spans = [(0, 1000, 3), (1000, 64, 0), (1064, 17, 5), (1081, 2, 7)]
    tokens = 1091
    q, k = (torch.randn(tokens, hk, d, device="cuda", generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(tokens, hv, d, device="cuda", generator=gen, dtype=dtype)
    g = -torch.rand(tokens, hv, device="cuda", generator=gen) * 0.3
    beta = torch.rand(tokens, hv, device="cuda", generator=gen).to(dtype)
    state0 = torch.randn(8, hv, d, d, device="cuda", generator=gen) * 0.1
    rows, slots = torch.tensor([1090, 3, 500, 7, 1082, 64, 65, 9], device="cuda"), torch.randperm(8, device="cuda")
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    for tuning in gd.TUNINGS.values():
        state, want_state = state0.clone(), state0.clone()
        out = torch.zeros_like(v)
        gd.gated_delta_chunks(q, k, v, g, beta, state, torch.tensor(spans, device="cuda"), out, tuning)
        for start, n, slot in spans:
            r = slice(start, start + n)
            o, want_state[slot] = gd.chunk_reference(q[r].float(), k[r].float(), v[r].float(), g[r], beta[r].float(),
                                                     want_state[slot])  # fmt: skip
            torch.testing.assert_close(out[r].float(), o, **tol, msg=lambda e, t=tuning: f"{t.name} chunks: {e}")
        torch.testing.assert_close(state, want_state, atol=1e-3, rtol=1e-3)
        o, s = gd.step_reference(q[rows].float(), k[rows].float(), v[rows].float(), g[rows], beta[rows].float(),
                                 state.index_select(0, slots))  # fmt: skip
        gd.gated_delta_step(q, k, v, g, beta, state, rows, slots, out, tuning)
        torch.testing.assert_close(out[rows].float(), o, **tol, msg=lambda e, t=tuning: f"{t.name} step: {e}")
        torch.testing.assert_close(state.index_select(0, slots), s, atol=1e-4, rtol=1e-4)
