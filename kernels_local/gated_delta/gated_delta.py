"""The gated delta rule (Gated DeltaNet's token mixer) as two Triton kernels, their torch
references, and per-architecture launch tuning.

Per value head, with a state `S [Dk, Dv]` in fp32: `S = exp(g_t) S`, then
`S += k_t (beta_t (v_t - S^T k_t))^T` and `o_t = S^T q_t`, q and k L2-normalized, q scaled by
`Dk^-1/2`. One program per (sequence, value head, `BV` columns of the state): the decode kernel
steps one token with its slice of the state in registers; the prefill kernel runs the chunked (WY)
form `CHUNK` tokens at a time, its products over the key dim in `BK`-wide blocks, the state kept in
its slot (a round trip through L2 per chunk instead of register spills). The trade-off: every dot
is fp32 with `input_precision="ieee"` (the state accumulates every token's update), so Hopper's
wgmma and Ampere's tf32 mma go unused; a bf16-operand variant could buy them back at the cost of
the state's precision. Layout: `gated_delta_step`; the tunings: `GatedDeltaTuning`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

# Runtime integers compiled once for every value (no divisibility or ==1 specialization), so one
# compiled launch per (tuning, head dims, dtype) serves every step.
_UNSPECIALIZED = ("stride_q", "stride_k", "stride_v", "stride_g", "stride_b", "stride_o", "group", "num_heads")
EPS = 1e-6  # of the L2 norm of q and k, as FLA and transformers


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _gated_delta_step_kernel(
    Q, K, V, G, BETA, STATE, OUT, ROWS, SLOTS,
    stride_q, stride_k, stride_v, stride_g, stride_b, stride_o, group, num_heads,
    key_dim, value_dim, scale,
    DK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    # 1. this program's row (its packed token), value head, key head and state columns
    n = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    row = tl.load(ROWS + n).to(tl.int64)
    slot = tl.load(SLOTS + n).to(tl.int64)
    kh = h // group
    d = tl.arange(0, DK)
    d_mask = d < key_dim
    c_mask = cols < value_dim
    # 2. q and k of the token, L2-normalized (q scaled), v's columns, decay and write strength
    q = tl.load(Q + row * stride_q + kh * key_dim + d, mask=d_mask, other=0.0).to(tl.float32)
    k = tl.load(K + row * stride_k + kh * key_dim + d, mask=d_mask, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(V + row * stride_v + h * value_dim + cols, mask=c_mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + h).to(tl.float32)
    beta = tl.load(BETA + row * stride_b + h).to(tl.float32)
    # 3. the slot's state columns [DK, BV], decayed
    s_ptr = STATE + ((slot * num_heads + h) * key_dim + d[:, None]) * value_dim + cols[None, :]
    s_mask = d_mask[:, None] & c_mask[None, :]
    s = tl.load(s_ptr, mask=s_mask, other=0.0) * tl.exp(g)
    # 4. the delta rule's write: beta (v - S^T k) at key k
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    # 5. read at q; store the output and the state back in place
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(OUT + row * stride_o + h * value_dim + cols, o.to(OUT.dtype.element_ty), mask=c_mask)
    tl.store(s_ptr, s, mask=s_mask)


@triton.jit
def _key_block(X, rows, stride, head, key_dim, t_mask, d0, BK: tl.constexpr):
    # columns d0 .. d0 + BK of a head's query or key rows, fp32 (zeros past the span and the key dim)
    d = d0 + tl.arange(0, BK)
    mask = t_mask[:, None] & (d < key_dim)[None, :]
    return tl.load(X + rows[:, None] * stride + head * key_dim + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _state_block(s_base, d0, cols, key_dim, value_dim, BK: tl.constexpr):
    # pointers and mask of the state rows d0 .. d0 + BK at this program's columns
    d = d0 + tl.arange(0, BK)
    return s_base + d[:, None] * value_dim + cols[None, :], (d < key_dim)[:, None] & (cols < value_dim)[None, :]


# The chunked (WY) form, per chunk: the cumulative log decay `c`; over the key blocks `k k^T`,
# `q k^T` and the state read at decayed keys and queries (`k exp(c) S`, `q exp(c) S`);
# `A = tril(beta k k^T * exp(c_i - c_j), -1)` and `T = (I + A)^-1` by forward substitution (the
# eliminations of `torch.linalg.solve_triangular`, stable however alike the keys are, where a
# Neumann product would sum binomially growing terms); the writes `fresh = T (beta v - beta k exp(c) S)`,
# the output `q exp(c) S + tril(q k^T exp(c_i - c_j)) fresh`, then the state stepped once, block by
# block: `S exp(c_last) + (k exp(c_last - c))^T fresh`. Tokens past the span's end load as zeros
# (beta 0, g 0), which write and decay nothing. Why key blocks: fp32 dots reducing over the whole
# key dim (128) keep it all per thread (FMA dots) and spilled on every CUDA target; a `BK`-wide
# block reduces over at most 32.
@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _gated_delta_chunk_kernel(
    Q, K, V, G, BETA, STATE, OUT, SPANS,
    stride_q, stride_k, stride_v, stride_g, stride_b, stride_o, group, num_heads,
    key_dim, value_dim, scale,
    CHUNK: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    # 1. this program's span (first row, tokens, slot), value head, key head and state columns
    p = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    start = tl.load(SPANS + p * 3).to(tl.int64)
    length = tl.load(SPANS + p * 3 + 1).to(tl.int32)
    slot = tl.load(SPANS + p * 3 + 2).to(tl.int64)
    kh = h // group
    c_mask = cols < value_dim
    i = tl.arange(0, CHUNK)
    lower = i[:, None] > i[None, :]  # strictly below the diagonal
    causal = i[:, None] >= i[None, :]
    eye = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    s_base = STATE + (slot * num_heads + h) * key_dim * value_dim  # the slot's state [Dk, Dv], updated in place
    for c0 in range(0, length, CHUNK):
        # 2. the chunk's v, g, beta (zeros past the span's end), and q's and k's inverse L2 norms
        t_mask = (c0 + i) < length
        rows = start + c0 + i
        v_mask = t_mask[:, None] & c_mask[None, :]
        v = tl.load(V + rows[:, None] * stride_v + h * value_dim + cols[None, :], mask=v_mask, other=0.0)
        v = v.to(tl.float32)
        g = tl.load(G + rows * stride_g + h, mask=t_mask, other=0.0).to(tl.float32)
        beta = tl.load(BETA + rows * stride_b + h, mask=t_mask, other=0.0).to(tl.float32)
        q_sq = tl.zeros((CHUNK,), dtype=tl.float32)
        k_sq = tl.zeros((CHUNK,), dtype=tl.float32)
        for d0 in range(0, DK, BK):
            qb = _key_block(Q, rows, stride_q, kh, key_dim, t_mask, d0, BK)
            kb = _key_block(K, rows, stride_k, kh, key_dim, t_mask, d0, BK)
            q_sq += tl.sum(qb * qb, axis=1)
            k_sq += tl.sum(kb * kb, axis=1)
        q_in = scale / tl.sqrt(q_sq + 1e-6)  # [CHUNK] q's normalization and scale
        k_in = 1.0 / tl.sqrt(k_sq + 1e-6)
        # 3. cumulative log decay in the chunk, and the decay between positions (i >= j)
        c = tl.cumsum(g, axis=0)
        decay = tl.exp(tl.where(causal, c[:, None] - c[None, :], float("-inf")))
        # 4. over the key dim in blocks: k k^T, q k^T, and the state read at decayed k and q
        kk = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        qk = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        ks = tl.zeros((CHUNK, BV), dtype=tl.float32)
        qs = tl.zeros((CHUNK, BV), dtype=tl.float32)
        for d0 in range(0, DK, BK):
            qb = _key_block(Q, rows, stride_q, kh, key_dim, t_mask, d0, BK) * q_in[:, None]
            kb = _key_block(K, rows, stride_k, kh, key_dim, t_mask, d0, BK) * k_in[:, None]
            s_ptr, s_mask = _state_block(s_base, d0, cols, key_dim, value_dim, BK)
            sb = tl.load(s_ptr, mask=s_mask, other=0.0)  # [BK, BV]
            kk += tl.dot(kb, tl.trans(kb), input_precision="ieee")
            qk += tl.dot(qb, tl.trans(kb), input_precision="ieee")
            ks += tl.dot(kb * tl.exp(c)[:, None], sb, input_precision="ieee")
            qs += tl.dot(qb * tl.exp(c)[:, None], sb, input_precision="ieee")
        # 5. A = tril(beta k k^T decay, -1) and T = (I + A)^-1, row by row (forward substitution)
        a = tl.where(lower, kk * beta[:, None] * decay, 0.0)
        inv = eye
        for r in range(1, CHUNK):
            a_r = tl.sum(tl.where(i[:, None] == r, a, 0.0), axis=0)  # row r of A [CHUNK]
            t_r = tl.sum(a_r[:, None] * inv, axis=0)  # sum_j A[r, j] T[j, :]
            inv = tl.where(i[:, None] == r, eye - t_r[None, :], inv)
        # 6. the chunk's writes: T (beta v) less what the state already predicts, T (beta exp(c) k S)
        fresh = tl.dot(inv, v * beta[:, None] - ks * beta[:, None], input_precision="ieee")  # [CHUNK, BV]
        # 7. outputs: the state before the chunk, read at decayed q, plus the chunk's own writes
        o = qs + tl.dot(tl.where(causal, qk * decay, 0.0), fresh, input_precision="ieee")
        tl.store(OUT + rows[:, None] * stride_o + h * value_dim + cols[None, :], o.to(OUT.dtype.element_ty),
                 mask=v_mask)  # fmt: skip
        # 8. step the state over the chunk, block by block: decayed to its end, plus every write
        # decayed from its token on (every thread's reads of this chunk are done first)
        last = tl.sum(g, axis=0)
        tl.debug_barrier()
        for d0 in range(0, DK, BK):
            kb = _key_block(K, rows, stride_k, kh, key_dim, t_mask, d0, BK) * (k_in * tl.exp(last - c))[:, None]
            s_ptr, s_mask = _state_block(s_base, d0, cols, key_dim, value_dim, BK)
            sb = tl.load(s_ptr, mask=s_mask, other=0.0) * tl.exp(last)
            tl.store(s_ptr, sb + tl.dot(tl.trans(kb), fresh, input_precision="ieee"), mask=s_mask)
        tl.debug_barrier()  # the next chunk reads the state other threads wrote


# -- torch references ------------------------------------------------------------------------


def _normed(q: torch.Tensor, k: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., Hk, Dk] -> fp32 [..., Hv, Dk], each key head repeated for its value heads,
    L2-normalized, q scaled."""
    if q.shape[-2] != heads:
        q = q.repeat_interleave(heads // q.shape[-2], dim=-2)
        k = k.repeat_interleave(heads // k.shape[-2], dim=-2)
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + EPS) * q.shape[-1] ** -0.5
    return q, k * torch.rsqrt((k * k).sum(-1, keepdim=True) + EPS)


def step_reference(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv], state [N, Hv, Dk, Dv]
    -> (out [N, Hv, Dv] in v's dtype, new state fp32)."""
    q, k = _normed(q, k, v.shape[-2])
    s = state.float() * g.float().exp()[..., None, None]
    delta = (v.float() - (s * k[..., None]).sum(-2)) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2).to(v.dtype), s


def chunk_reference(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's span in the chunked form: q, k [L, Hk, Dk], v [L, Hv, Dv], g, beta [L, Hv],
    state [Hv, Dk, Dv] -> (out [L, Hv, Dv] in v's dtype, new state fp32)."""
    length, dtype = v.shape[0], v.dtype
    q, k = _normed(q, k, v.shape[-2])
    q, k, v = (t.transpose(0, 1) for t in (q, k, v.float()))  # [Hv, L, D]
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)  # [Hv, L]
    pad = -length % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = q.shape[1] // chunk
    kb, vb = k * beta[..., None], v * beta[..., None]
    q, k, kb, vb = (t.unflatten(1, (n, chunk)) for t in (q, k, kb, vb))  # [Hv, N, C, D]
    c = g.unflatten(1, (n, chunk)).cumsum(-1)  # [Hv, N, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(upper, float("-inf")).exp()
    a = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(a, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a, kb * c.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_in, k_out = q * c.exp()[..., None], k * (c[..., -1:] - c).exp()[..., None]
    s, out = state.float(), torch.empty_like(u)
    for j in range(n):
        fresh = u[:, j] - w[:, j] @ s
        out[:, j] = q_in[:, j] @ s + inner[:, j] @ fresh
        s = s * c[:, j, -1].exp()[:, None, None] + k_out[:, j].transpose(-1, -2) @ fresh
    return out.flatten(1, 2)[:, :length].transpose(0, 1).to(dtype), s


def gated_delta_reference(q, k, v, g, beta, state: torch.Tensor, decode_rows, decode_slots,
                          spans: list[tuple[int, int, int]], chunk: int = 64,
                          token_by_token: bool = False) -> torch.Tensor:  # fmt: skip
    """A whole step in torch: decode rows (`decode_rows` [Nd] rows or a slice, their
    `decode_slots` [Nd]) one recurrent step each, then each `(row start, tokens, slot)` span
    chunked (token by token with `token_by_token`); `state` updated in place -> out [T, Hv, Dv]."""
    out = torch.empty_like(v)
    if decode_slots is not None:
        r = decode_rows
        o, s = step_reference(q[r], k[r], v[r], g[r], beta[r], state.index_select(0, decode_slots))
        out[r] = o
        state.index_copy_(0, decode_slots, s)
    for start, n, slot in spans:
        if token_by_token:
            s = state[slot : slot + 1]
            for t in range(start, start + n):
                out[t : t + 1], s = step_reference(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1],
                                                   beta[t : t + 1], s)  # fmt: skip
            state[slot] = s[0]
            continue
        r = slice(start, start + n)
        out[r], state[slot] = chunk_reference(q[r], k[r], v[r], g[r], beta[r], state[slot], chunk)
    return out


# -- launches ---------------------------------------------------------------------------------


STEP_STATE_REGISTERS = 32  # fp32 state values per thread in the decode kernel (64 spilled at 16 warps)


@dataclass(frozen=True)
class GatedDeltaTuning:
    """Launch shape for one architecture family: `CHUNK` tokens, `BV` state columns per program, `BK`
    key columns per block, warps (`DK` is the key head dim's next power of two). Each compiles
    without spills on its targets for head dims 64 to 512 (`hetserve plan --compile`):
    - pre-Hopper (sm_70..sm_89): 16-token chunks, 16 key columns, 32 state columns, 4 warps;
    - Hopper and later (sm_90+): 16-token chunks, 16 key columns, 32 state columns, 16 warps
      (32-token chunks and 8 warps spilled on sm_100, 64 state columns on sm_100, sm_103, sm_120);
    - ROCm (64-lane wavefronts, fp32 MFMA): 16-token chunks, 32 key columns, 64 state columns,
      4 wavefronts.
    Registers per tuning: docs/benchmarks.md "Preflight matrix"."""

    name: str
    chunk: int  # tokens per chunk of the chunked kernel (>= 16: tl.dot's smallest side)
    block_v: int  # state columns per program
    num_warps: int
    block_k: int = 32  # key-dim columns per block of the chunked kernel's products with the state

    def launch_shape(self, key_dim: int, value_dim: int, step: bool = False) -> tuple[int, int, int]:
        """(DK, BV, warps): the key dim padded to a power of two, the columns per program. The decode
        kernel (`step`) holds its `[DK, BV]` slice of the state in registers: at most
        `STEP_STATE_REGISTERS` per thread, so wide key dims get fewer columns (no spills)."""
        dk = max(16, triton.next_power_of_2(key_dim))
        bv = min(self.block_v, triton.next_power_of_2(value_dim))
        if step:
            bv = min(bv, STEP_STATE_REGISTERS * 32 * self.num_warps // dk)
        return dk, max(16, bv), self.num_warps


PRE_HOPPER = GatedDeltaTuning("sm70", chunk=16, block_v=32, num_warps=4, block_k=16)
HOPPER = GatedDeltaTuning("sm90", chunk=16, block_v=32, num_warps=16, block_k=16)
ROCM = GatedDeltaTuning("rocm", chunk=16, block_v=64, num_warps=4, block_k=32)
TUNINGS = {t.name: t for t in (PRE_HOPPER, HOPPER, ROCM)}

# Kernels made while TRITON_INTERPRET=1 run on CPU tensors (tests); others need a GPU.
_INTERPRETED = type(_gated_delta_step_kernel).__name__ == "InterpretedFunction"


def runs_triton(x: torch.Tensor) -> bool:
    """Whether a launch on `x` runs the kernels (GPU tensor, or the interpreter on CPU)."""
    return x.is_cuda or _INTERPRETED


def _checked(q, k, v, g, beta, state) -> tuple[int, int, int, int]:
    """(Hk, Dk, Hv, Dv) of a step's operands, or a `ValueError` naming what does not fit."""
    hk, dk = q.shape[-2:]
    hv, dv = v.shape[-2:]
    if k.shape[-2:] != (hk, dk) or hv % hk or state.shape[1:] != (hv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"Gated delta rule operands do not fit: q, k `{tuple(q.shape)}` / `{tuple(k.shape)}`, v "
                         f"`{tuple(v.shape)}`, state `{tuple(state.shape)}` {state.dtype}. Needed: q and k "
                         f"[T, Hk, Dk], v [T, Hv, Dv] with Hk dividing Hv, state [S, Hv, Dk, Dv] float32")
    if not state.is_contiguous() or any(t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (q, k, v)):
        raise ValueError("The state must be contiguous and q, k, v rows of contiguous heads (any row stride)")
    return hk, dk, hv, dv


def _args(q, k, v, g, beta, out):
    """The row strides and head counts the kernels take, in their order."""
    return (q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), out.stride(0),
            v.shape[-2] // q.shape[-2], v.shape[-2])  # fmt: skip


def gated_delta_step(q, k, v, g, beta, state, rows: torch.Tensor, slots: torch.Tensor, out: torch.Tensor,
                     tuning: GatedDeltaTuning = PRE_HOPPER) -> None:  # fmt: skip
    """Decode rows: packed row `rows[n]` steps slot `slots[n]` of `state` once (in place) and writes
    its output row of `out` [T, Hv, Dv].

    Layout (the worker's state pool, workers/kv/state.py): `state [S, Hv, Dk, Dv]` fp32, one slot per
    sequence, read at a chunk's start and written back at its end in place; q, k `[T, Hk, Dk]`,
    v `[T, Hv, Dv]`, g (log decay, fp32) and beta `[T, Hv]` are the step's packed tokens, any row
    stride (views of one projection); a key head serves `Hv / Hk` consecutive value heads."""
    _, dk, hv, dv = _checked(q, k, v, g, beta, state)
    if not runs_triton(q):
        o, s = step_reference(q[rows], k[rows], v[rows], g[rows], beta[rows], state.index_select(0, slots))
        out[rows] = o
        state.index_copy_(0, slots, s)
        return
    pad_k, bv, warps = tuning.launch_shape(dk, dv, step=True)
    grid = (rows.shape[0], hv, triton.cdiv(dv, bv))
    _gated_delta_step_kernel[grid](q, k, v, g, beta, state, out, rows, slots, *_args(q, k, v, g, beta, out), dk, dv,
                                   1.0 / math.sqrt(dk), DK=pad_k, BV=bv, num_warps=warps)  # fmt: skip


def gated_delta_chunks(q, k, v, g, beta, state, spans: torch.Tensor, out: torch.Tensor,
                       tuning: GatedDeltaTuning = PRE_HOPPER) -> None:  # fmt: skip
    """Prefill spans: each `(row start, tokens, slot)` row of `spans` [P, 3] int64 runs its tokens
    from its slot's state in chunks of `tuning.chunk`, writes its rows of `out` and the state back."""
    _, dk, hv, dv = _checked(q, k, v, g, beta, state)
    if not runs_triton(q):
        for start, n, slot in spans.tolist():
            r = slice(start, start + n)
            out[r], state[slot] = chunk_reference(q[r], k[r], v[r], g[r], beta[r], state[slot], tuning.chunk)
        return
    pad_k, bv, warps = tuning.launch_shape(dk, dv)
    grid = (spans.shape[0], hv, triton.cdiv(dv, bv))
    _gated_delta_chunk_kernel[grid](q, k, v, g, beta, state, out, spans, *_args(q, k, v, g, beta, out), dk, dv,
                                    1.0 / math.sqrt(dk), CHUNK=tuning.chunk, DK=pad_k, BK=min(pad_k, tuning.block_k),
                                    BV=bv, num_warps=warps)  # fmt: skip


def compile_specs(tuning: GatedDeltaTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch the wrappers make with `tuning`: one step and one chunk kernel per head dim of
    the workload (the key and value heads of the DeltaNets we serve are alike: 128), in the
    workload's dtype (g, the state and the output's accumulation fp32)."""
    specs = []
    for d in workload.head_dims:
        pad_k, bv, warps = tuning.launch_shape(d, d)
        step_bv = tuning.launch_shape(d, d, step=True)[1]
        t, f32, index = pointer(workload.dtype), pointer("fp32"), pointer("i64")
        tensors = (("Q", t), ("K", t), ("V", t), ("G", f32), ("BETA", t), ("STATE", f32), ("OUT", t))
        sizes = (*((name, "i32") for name in _UNSPECIALIZED), ("key_dim", int_arg(d)), ("value_dim", int_arg(d)),
                 ("scale", "fp32"))  # fmt: skip
        specs.append(CompileSpec(_gated_delta_step_kernel, (*tensors, ("ROWS", index), ("SLOTS", index), *sizes),
                                 (("DK", pad_k), ("BV", step_bv)), warps))  # fmt: skip
        specs.append(CompileSpec(_gated_delta_chunk_kernel, (*tensors, ("SPANS", index), *sizes),
                                 (("CHUNK", tuning.chunk), ("DK", pad_k), ("BK", min(pad_k, tuning.block_k)),
                                  ("BV", bv)), warps))  # fmt: skip
    return unique(specs)
