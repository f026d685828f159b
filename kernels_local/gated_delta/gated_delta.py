"""The gated delta rule (Gated DeltaNet's token mixer) as two Triton kernels, their torch
references, and per-architecture launch tuning.

The recurrence, per value head with a state `S [Dk, Dv]` in fp32: `S = exp(g_t) S`, then
`S += k_t (beta_t (v_t - S^T k_t))^T` and `o_t = S^T q_t`, with q and k L2-normalized (eps
1e-6, as FLA and transformers) and q scaled by `Dk^-1/2`; a key head serves `Hv / Hk`
consecutive value heads. Layout (the worker's state pool, workers/kv/state.py): `state [S,
Hv, Dk, Dv]` fp32, one slot per sequence, read at a chunk's start and written back at its end
in place; q, k `[T, Hk, Dk]`, v `[T, Hv, Dv]`, g (log decay, fp32) and beta `[T, Hv]` are the
step's packed tokens, any row stride (they are views of one projection).

Design: one program per (sequence, value head, `BV` columns of the state), holding its
`[Dk, BV]` slice of the state in registers from the first token to the last, so the state
makes one round trip through memory per step, whatever the number of tokens.
- `_gated_delta_step_kernel` (decode: one token per row): one step of the recurrence with
  element-wise products and row sums, no `tl.dot`.
- `_gated_delta_chunk_kernel` (prefill spans): the chunked (WY) form, `CHUNK` tokens at a time:
  the cumulative log decay `c` of the chunk, `A = tril(beta k k^T * exp(c_i - c_j), -1)`, its
  unit-lower-triangular inverse `T = (I + A)^-1` by forward substitution (row by row in
  registers: the same eliminations as `torch.linalg.solve_triangular`, stable however alike
  the keys are, where a Neumann product would sum binomially growing terms), then
  `u = T (beta v)`, `w = T (beta k exp(c))`, the chunk's writes `u - w S`, its output
  `(q exp(c)) S + (tril(q k^T exp(c_i - c_j))) (u - w S)`, and the state stepped once:
  `S exp(c_last) + (k exp(c_last - c))^T (u - w S)`. Tokens past the span's end load as zeros
  (beta 0, g 0), which write and decay nothing.
Every dot is fp32 with `input_precision="ieee"` (no tf32: the state accumulates every token's
update); the trade-off is that Hopper's wgmma and Ampere's tf32 mma go unused, which a
bf16-operand variant could buy back at the cost of the state's precision.

Launch configurations (`GatedDeltaTuning`): `CHUNK` tokens, `BV` state columns per program,
warps; `DK` is the key head dim's next power of two (the whole key dim per program: the
L2 norm and `k k^T` need it), `DV_PAD` the value head dim's.
- pre-Hopper (sm_70..sm_89): 16-token chunks, 32 columns, 4 warps;
- Hopper and later (sm_90+): 32-token chunks, 64 columns, 8 warps (more of the state and of
  the chunk in flight per SM);
- ROCm (64-lane wavefronts): 16-token chunks, 64 columns, 4 wavefronts.
Row strides, slots and counts are runtime integers that Triton does not specialize, so one
compiled launch per (tuning, head dims, dtype) serves every step; `compile_specs` declares
exactly those launches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels_local.compile_spec import CompileSpec, Workload, int_arg, pointer, unique

# Runtime integers compiled once for every value (no divisibility or ==1 specialization).
_UNSPECIALIZED = ("stride_q", "stride_k", "stride_v", "stride_g", "stride_b", "stride_o", "group", "num_heads")
EPS = 1e-6  # of the L2 norm of q and k


@triton.jit
def _l2norm_rows(x):
    # each row divided by sqrt(sum of squares + eps): [R, D] fp32
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]


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


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _gated_delta_chunk_kernel(
    Q, K, V, G, BETA, STATE, OUT, SPANS,
    stride_q, stride_k, stride_v, stride_g, stride_b, stride_o, group, num_heads,
    key_dim, value_dim, scale,
    CHUNK: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    # 1. this program's span (first row, tokens, slot), value head, key head and state columns
    p = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    start = tl.load(SPANS + p * 3).to(tl.int64)
    length = tl.load(SPANS + p * 3 + 1).to(tl.int32)
    slot = tl.load(SPANS + p * 3 + 2).to(tl.int64)
    kh = h // group
    d = tl.arange(0, DK)
    d_mask = d < key_dim
    c_mask = cols < value_dim
    i = tl.arange(0, CHUNK)
    lower = i[:, None] > i[None, :]  # strictly below the diagonal
    causal = i[:, None] >= i[None, :]
    eye = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    # 2. the slot's state columns [DK, BV], kept in registers over the whole span
    s_ptr = STATE + ((slot * num_heads + h) * key_dim + d[:, None]) * value_dim + cols[None, :]
    s_mask = d_mask[:, None] & c_mask[None, :]
    s = tl.load(s_ptr, mask=s_mask, other=0.0)
    for c0 in range(0, length, CHUNK):
        # 3. the chunk's tokens (zeros past the span's end): q, k normalized, v, g, beta
        t_mask = (c0 + i) < length
        rows = start + c0 + i
        qk_mask = t_mask[:, None] & d_mask[None, :]
        q = tl.load(Q + rows[:, None] * stride_q + kh * key_dim + d[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        k = tl.load(K + rows[:, None] * stride_k + kh * key_dim + d[None, :], mask=qk_mask, other=0.0).to(tl.float32)
        q = _l2norm_rows(q) * scale
        k = _l2norm_rows(k)
        v_mask = t_mask[:, None] & c_mask[None, :]
        v = tl.load(V + rows[:, None] * stride_v + h * value_dim + cols[None, :], mask=v_mask, other=0.0)
        v = v.to(tl.float32)
        g = tl.load(G + rows * stride_g + h, mask=t_mask, other=0.0).to(tl.float32)
        beta = tl.load(BETA + rows * stride_b + h, mask=t_mask, other=0.0).to(tl.float32)
        # 4. cumulative log decay in the chunk, and the decay between positions (i >= j)
        c = tl.cumsum(g, axis=0)
        decay = tl.exp(tl.where(causal, c[:, None] - c[None, :], float("-inf")))
        # 5. A = tril(beta k k^T decay, -1) and T = (I + A)^-1, row by row (forward substitution)
        kb = k * beta[:, None]
        a = tl.where(lower, tl.dot(kb, tl.trans(k), input_precision="ieee") * decay, 0.0)
        inv = eye
        for r in range(1, CHUNK):
            a_r = tl.sum(tl.where(i[:, None] == r, a, 0.0), axis=0)  # row r of A [CHUNK]
            t_r = tl.sum(a_r[:, None] * inv, axis=0)  # sum_j A[r, j] T[j, :]
            inv = tl.where(i[:, None] == r, eye - t_r[None, :], inv)
        # 6. the chunk's writes: T (beta v) less what the state already predicts, T (beta k exp(c)) S
        u = tl.dot(inv, v * beta[:, None], input_precision="ieee")  # [CHUNK, BV]
        w = tl.dot(inv, kb * tl.exp(c)[:, None], input_precision="ieee")  # [CHUNK, DK]
        fresh = u - tl.dot(w, s, input_precision="ieee")
        # 7. outputs: the state before the chunk, read at decayed q, plus the chunk's own writes
        inner = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        o = tl.dot(q * tl.exp(c)[:, None], s, input_precision="ieee") + tl.dot(inner, fresh, input_precision="ieee")
        tl.store(OUT + rows[:, None] * stride_o + h * value_dim + cols[None, :], o.to(OUT.dtype.element_ty),
                 mask=v_mask)  # fmt: skip
        # 8. step the state over the chunk: decayed to its end, plus every write decayed from its token on
        last = tl.sum(g, axis=0)
        k_out = k * tl.exp(last - c)[:, None]
        s = s * tl.exp(last) + tl.dot(tl.trans(k_out), fresh, input_precision="ieee")
    # 9. the state back into its slot
    tl.store(s_ptr, s, mask=s_mask)


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


@dataclass(frozen=True)
class GatedDeltaTuning:
    """Launch shape for one architecture family."""

    name: str
    chunk: int  # tokens per chunk of the chunked kernel (>= 16: tl.dot's smallest side)
    block_v: int  # state columns per program
    num_warps: int

    def launch_shape(self, key_dim: int, value_dim: int) -> tuple[int, int, int]:
        """(DK, BV, warps): the key dim padded to a power of two, the columns per program."""
        dk = max(16, triton.next_power_of_2(key_dim))
        return dk, max(16, min(self.block_v, triton.next_power_of_2(value_dim))), self.num_warps


PRE_HOPPER = GatedDeltaTuning("sm70", chunk=16, block_v=32, num_warps=4)
HOPPER = GatedDeltaTuning("sm90", chunk=32, block_v=64, num_warps=8)
ROCM = GatedDeltaTuning("rocm", chunk=16, block_v=64, num_warps=4)
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
    its output row of `out` [T, Hv, Dv]; operands as the module docstring lays them out."""
    _, dk, hv, dv = _checked(q, k, v, g, beta, state)
    if not runs_triton(q):
        o, s = step_reference(q[rows], k[rows], v[rows], g[rows], beta[rows], state.index_select(0, slots))
        out[rows] = o
        state.index_copy_(0, slots, s)
        return
    pad_k, bv, warps = tuning.launch_shape(dk, dv)
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
                                    1.0 / math.sqrt(dk), CHUNK=tuning.chunk, DK=pad_k, BV=bv,
                                    num_warps=warps)  # fmt: skip


def compile_specs(tuning: GatedDeltaTuning, workload: Workload) -> tuple[CompileSpec, ...]:
    """Every launch the wrappers make with `tuning`: one step and one chunk kernel per head dim of
    the workload (the key and value heads of the DeltaNets we serve are alike: 128), in the
    workload's dtype (g, the state and the output's accumulation fp32)."""
    specs = []
    for d in workload.head_dims:
        pad_k, bv, warps = tuning.launch_shape(d, d)
        t, f32, index = pointer(workload.dtype), pointer("fp32"), pointer("i64")
        tensors = (("Q", t), ("K", t), ("V", t), ("G", f32), ("BETA", t), ("STATE", f32), ("OUT", t))
        sizes = (*((name, "i32") for name in _UNSPECIALIZED), ("key_dim", int_arg(d)), ("value_dim", int_arg(d)),
                 ("scale", "fp32"))  # fmt: skip
        specs.append(CompileSpec(_gated_delta_step_kernel, (*tensors, ("ROWS", index), ("SLOTS", index), *sizes),
                                 (("DK", pad_k), ("BV", bv)), warps))  # fmt: skip
        specs.append(CompileSpec(_gated_delta_chunk_kernel, (*tensors, ("SPANS", index), *sizes),
                                 (("CHUNK", tuning.chunk), ("DK", pad_k), ("BV", bv)), warps))  # fmt: skip
    return unique(specs)
