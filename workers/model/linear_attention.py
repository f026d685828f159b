"""Gated DeltaNet: the linear-attention layers of Qwen3.5 / Qwen3.6 and Qwen3-Next, in plain torch.

Per token and value head a state `S [Dk, Dv]` decays by `exp(g_t)`, the delta rule writes
`beta_t (v_t - S^T k_t)` at key `k_t`, and the output reads `S^T q_t` (q, k L2-normed, q scaled
by `Dk^-1/2`); a short causal convolution (SiLU) precedes it and a `silu(z)`-gated RMSNorm
follows (`GatedRMSNorm`); a key head serves `Hv / Hk` value heads, as GQA. Design: two forms of
one recurrence, as transformers and vLLM compute it: `recurrent_delta_rule` token by token
(decode) and `chunked_delta_rule`, a chunk of tokens as a few matmuls (the WY form), the state
stepped once per chunk (prefill). `GatedDeltaNet.step` reads each sequence's conv and recurrent
state from its slot (workers/kv/state.py) at a chunk's start and writes it at its end, so a
chunked prompt ends in the state one whole prefill gives. The rule is the kernel-swappable
`GatedDeltaRule` (Triton on GPUs: kernels_local/gated_delta/); the convolution stays in torch.
Trade-off: the chunked form rounds slightly otherwise than the recurrent one in fp32, so
`--deterministic` steps every token recurrently, at the price of a slower prefill."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels import use_kernel_forward_from_hub
from torch import nn

from workers.model.deterministic import tail_free

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's default)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and transformers' eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g, beta [B, S, Hv] -> fp32 [B, Hv, S, ...], each key
    head repeated for its value heads, q and k normalized, q scaled."""
    hv = v.shape[-2]
    if q.shape[-2] != hv:
        q = q.repeat_interleave(hv // q.shape[-2], dim=2)
        k = k.repeat_interleave(hv // k.shape[-2], dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k), v, g, beta


def recurrent_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None):
    """Token by token: q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g, beta [B, S, Hv], state [B, Hv, Dk,
    Dv] (None: zeros) -> (out [B, S, Hv, Dv] in v's dtype, final state fp32)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, hv, s, dk = k.shape
    state = q.new_zeros(b, hv, dk, v.shape[-1]) if state is None else state.float()
    out = torch.empty_like(v)  # [B, Hv, S, Dv]
    decay = tail_free(torch.exp, g)  # [B, Hv, S]: the same bits however many rows and tokens come together
    for t in range(s):
        kt = k[:, :, t, :, None]  # [B, Hv, Dk, 1]
        state = state * decay[:, :, t, None, None]  # 1. decay
        delta = (v[:, :, t] - (state * kt).sum(dim=-2)) * beta[:, :, t, None]  # 2. what the state mispredicts
        state = state + kt * delta[:, :, None, :]  # 3. the delta rule's write
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)  # 4. read at q
    return out.transpose(1, 2).to(dtype), state


def chunked_delta_rule(q, k, v, g, beta, state: torch.Tensor | None = None, chunk: int = CHUNK):
    """Chunk by chunk (the WY form), the same arguments and results as `recurrent_delta_rule`."""
    dtype, length = v.dtype, v.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, hv, _, dk = k.shape
    # 1. pad to whole chunks (padded tokens have beta 0 and g 0: they write and decay nothing)
    pad = -length % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // chunk
    kb, vb = k * beta[..., None], v * beta[..., None]
    q, k, kb, vb = (t.unflatten(2, (n, chunk)) for t in (q, k, kb, vb))  # [B, Hv, N, C, D]
    g = g.unflatten(2, (n, chunk)).cumsum(-1)  # [B, Hv, N, C] log decay from the chunk's start
    # 2. within a chunk: decays between positions (i >= j), the triangular system and the reads
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [B, Hv, N, C, C]
    system = (kb @ k.transpose(-1, -2)) * decay  # its strictly lower part: earlier writes seen by later keys
    inner = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)  # [B, Hv, N, C, Dv]
    w = torch.linalg.solve_triangular(system, kb * g.exp()[..., None], upper=False, unitriangular=True)
    # 3. across chunks: each reads the state before it, then steps it once
    state = q.new_zeros(b, hv, dk, v.shape[-1]) if state is None else state.float()
    out = torch.empty_like(u)
    q_in = q * g.exp()[..., None]  # decayed from the chunk's start
    k_out = k * (g[..., -1:] - g).exp()[..., None]  # decayed to the chunk's end
    step = g[..., -1].exp()[..., None, None]  # [B, Hv, N, 1, 1]
    for i in range(n):
        fresh = u[:, :, i] - w[:, :, i] @ state  # [B, Hv, C, Dv] the writes, less what the state predicts
        out[:, :, i] = q_in[:, :, i] @ state + inner[:, :, i] @ fresh
        state = state * step[:, :, i] + k_out[:, :, i].transpose(-1, -2) @ fresh
    return out.flatten(2, 3)[:, :, :length].transpose(1, 2).to(dtype), state


def _rows(decode) -> slice | torch.Tensor:
    """The packed rows of a step's decode tokens: a slice when consecutive."""
    return decode.rows if decode.rows_start is None else slice(decode.rows_start, decode.rows_start + decode.num)


@use_kernel_forward_from_hub("GatedDeltaRule")
class GatedDeltaRule(nn.Module):
    """The gated delta rule of one step over the state pool (kernel-swappable, stateless).

    `forward(q [T, Hk, Dk], k, v [T, Hv, Dv], g [T, Hv] fp32, beta [T, Hv], state [S, Hv, Dk, Dv]
    fp32, batch) -> [T, Hv, Dv]`, where `state` is this layer's recurrent state of every slot,
    read and written in place at the slots of `batch.states` (workers/kv/state.py `StateBatch`),
    and `batch` the step's `ForwardBatch` (its `decode` rows and `prefills` spans). The torch
    path: decode rows together, token by token; prefill spans one by one, chunked (every span
    token by token when `token_by_token`: `--deterministic`).
    """

    token_by_token: bool = False
    chunk: int = CHUNK

    def forward(self, q, k, v, g, beta, state: torch.Tensor, batch) -> torch.Tensor:
        out = torch.empty_like(v)  # [T, Hv, Dv]
        slots = batch.states
        if batch.decode is not None:  # 1. decode rows: one recurrent step each, from their slots
            rows = _rows(batch.decode)
            s = state.index_select(0, slots.decode_slots)  # [Nd, Hv, Dk, Dv]
            o, s = recurrent_delta_rule(q[rows, None], k[rows, None], v[rows, None], g[rows, None], beta[rows, None], s)
            out[rows] = o[:, 0]
            state.index_copy_(0, slots.decode_slots, s)
        rule = recurrent_delta_rule if self.token_by_token else chunked_delta_rule
        for span, slot in zip(batch.prefills, slots.prefill_slots, strict=True):  # 2. prefill spans
            r = slice(span.row_start, span.row_start + span.num_tokens)
            o, s = rule(q[None, r], k[None, r], v[None, r], g[None, r], beta[None, r], state[slot : slot + 1])
            out[r] = o[0]
            state[slot] = s[0]
        return out


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then gated: `(w * norm(x).to(dtype)) * silu(z)` in fp32, cast last
    (`tail_free`, deterministic mode: the SiLU over a padded tensor, workers/model/deterministic.py)."""

    tail_free: bool = False

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        h = self.weight * h.to(x.dtype)
        gate = gate.float()
        return (h * (tail_free(F.silu, gate) if self.tail_free else F.silu(gate))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer: x [.., H] -> [.., H], with the `Attention` module's two entry points."""

    window = None  # no sliding window: the full forward passes this layer no mask
    # deterministic mode: the gates and the convolution's SiLU over padded tensors, the convolution's
    # taps summed in order for every row (workers/model/deterministic.py `tail_free`)
    tail_free: bool = False

    def __init__(self, config, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.hk, self.hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.conv_dim, self.kernel = config.linear_conv_dim, config.linear_conv_kernel
        h, vs = config.hidden_size, config.linear_value_size
        self.in_proj_qkvz = nn.Linear(h, self.conv_dim + vs, bias=False)  # [q | k | v | z]
        self.in_proj_ba = nn.Linear(h, 2 * self.hv, bias=False)  # [b | a]
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel))  # depthwise [C, 1, K]
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(vs, h, bias=False)
        self.rule = GatedDeltaRule()

    def _project(self, x: torch.Tensor):
        """x [.., H] -> conv input [.., C], z [.., Hv, Dv], beta and g [.., Hv] (g fp32)."""
        mixed, z = self.in_proj_qkvz(x).split((self.conv_dim, self.hv * self.dv), dim=-1)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)  # [.., Hv] each
        each = tail_free if self.tail_free else (lambda fn, t: fn(t))
        g = -self.A_log.float().exp() * each(F.softplus, a.float() + self.dt_bias)
        return mixed, z.unflatten(-1, (self.hv, self.dv)), each(torch.sigmoid, b), g

    def _split(self, mixed: torch.Tensor):
        """Convolved [.., C] -> q, k [.., Hk, Dk], v [.., Hv, Dv]."""
        ks = self.hk * self.dk
        q, k, v = mixed.split((ks, ks, self.hv * self.dv), dim=-1)
        return (q.unflatten(-1, (self.hk, self.dk)), k.unflatten(-1, (self.hk, self.dk)),
                v.unflatten(-1, (self.hv, self.dv)))

    def _out(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(o, z).flatten(-2))  # [.., Hv, Dv] -> [.., H]

    def forward(self, x: torch.Tensor, rope=None, mask=None, shared=None) -> torch.Tensor:
        """Full causal forward from a zero state, no cache: x [B, S, H] -> [B, S, H]."""
        mixed, z, beta, g = self._project(x)
        s = x.shape[1]
        conv = F.conv1d(mixed.transpose(1, 2), self.conv_weight, padding=self.kernel - 1, groups=self.conv_dim)
        q, k, v = self._split(F.silu(conv[..., :s]).transpose(1, 2))  # [B, S, C] convolved
        o, _ = chunked_delta_rule(q, k, v, g, beta)
        return self._out(o, z)

    def _convolve(self, mixed: torch.Tensor, conv_state: torch.Tensor, batch) -> torch.Tensor:
        """The causal convolution of one step over each sequence's last `K - 1` inputs (its conv
        state [S, C, K-1], updated in place): mixed [T, C] -> SiLU(conv) [T, C]."""
        out, slots = torch.empty_like(mixed), batch.states
        if batch.decode is not None:  # 1. decode rows: their K - 1 previous inputs, then this one
            rows = _rows(batch.decode)
            window = torch.cat((conv_state.index_select(0, slots.decode_slots), mixed[rows, :, None]), dim=-1)
            out[rows] = self._taps(window) if self.tail_free else \
                (window * self.conv_weight[:, 0]).sum(-1)  # [Nd, C, K] -> [Nd, C] (a depthwise conv1d is slower)
            conv_state.index_copy_(0, slots.decode_slots, window[..., 1:])
        for span, slot in zip(batch.prefills, slots.prefill_slots, strict=True):  # 2. prefill spans
            r = slice(span.row_start, span.row_start + span.num_tokens)
            window = torch.cat((conv_state[slot], mixed[r].transpose(0, 1)), dim=-1)[None]  # [1, C, K-1+n]
            if self.tail_free:  # every token's K taps, in the order a decode row sums them
                out[r] = self._taps(window[0].unfold(-1, self.kernel, 1).transpose(0, 1))  # [n, C, K] -> [n, C]
            else:
                out[r] = F.conv1d(window, self.conv_weight, groups=self.conv_dim)[0].transpose(0, 1)
            conv_state[slot] = window[0, :, -(self.kernel - 1) :]
        return tail_free(F.silu, out) if self.tail_free else F.silu(out)

    def _taps(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [N, C, K] -> [N, C]: each channel's K inputs times its weights, summed tap by tap
        (element-wise ops only: a row's sum does not depend on the others or on how many there are)."""
        w = self.conv_weight[:, 0]  # [C, K]
        acc = windows[..., 0] * w[:, 0]
        for j in range(1, self.kernel):
            acc = acc + windows[..., j] * w[:, j]
        return acc

    def step(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """One engine step over packed tokens: x [T, H] -> [T, H]; reads and writes the sequences' state."""
        batch = ctx.batch
        conv_state, recurrent = ctx.kv.states.layer(self.layer_index)  # [S, C, K-1], [S, Hv, Dk, Dv]
        if batch.states.fresh is not None:  # sequences starting now begin from a zero state
            ctx.kv.states.clear(self.layer_index, batch.states.fresh)
        mixed, z, beta, g = self._project(x)
        recorder = ctx.kv.states.recorder  # drafted rows' rollback (workers/model/state_rollback.py)
        recorded = recorder is not None and bool(batch.prefills) and \
            recorder.snapshot(self.layer_index, batch, conv_state, recurrent)
        q, k, v = self._split(self._convolve(mixed, conv_state, batch))
        if recorded:
            recorder.inputs(self.layer_index, mixed, q, k, v, g, beta)
        return self._out(self.rule(q, k, v, g, beta, recurrent, batch), z)
