"""A contiguous copy of the decoding sequences' K/V, kept across steps, for the CPU torch path.

Design: SDPA on the CPU reads each row's K/V as one matrix per head, and the pool keeps them in
blocks, so attention over blocks starts with a gather of every attended position per layer and
step, about as costly as the attention itself. Between two decode steps a sequence's K/V gain
only one position, so each decoding sequence owns a mirror row, filled from its blocks once when
it starts decoding (or returns from preemption), then given only the new token's K/V each step.
Rows are released when a sequence stops decoding or is preempted (the last row fills the hole).
The pool stays the source of truth; where the CPU decode kernel is loaded no mirror is kept, and
GPU kernels read the blocks in place. Trade-off: the decoding rows' K/V are held twice (the
mirror grows by doubling to the longest row), the price of contiguous-cache decode speed over a
paged pool."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def row_mask(lens: torch.Tensor, max_len: int, window: int | None) -> torch.Tensor:
    """[N, 1, 1, max_len] bool: row `n` attends positions `lens[n] - window .. lens[n] - 1` (all of
    `0 .. lens[n] - 1` without a window)."""
    cols = torch.arange(max_len, device=lens.device)[None, :]  # [1, L]
    mask = cols < lens[:, None]
    if window is not None:
        mask &= cols >= lens[:, None] - window
    return mask[:, None, None, :]


def step_mask(rows, lens: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """The mask of a step's decode `rows` (their `mask`, `masks`, `max_len`) when each attends
    only its last `window` positions: made once per step and window, `rows.mask` without one."""
    if window is None or window >= rows.max_len:
        return rows.mask
    if window not in rows.masks:
        rows.masks[window] = row_mask(lens, rows.max_len, window)
    return rows.masks[window]


def attend_rows(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scale: float | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per row: `query` [N, Hq, D], `k`, `v` [N, Hkv, L, D] -> [N, Hq, D].
    The query heads of a KV group are folded into the query axis, so GQA repeats no K/V. SDPA,
    or, with a `softcap` (scores -> cap * tanh(scores / cap)) or per-head `sinks` [Hq], the same
    in explicit ops."""
    n, n_heads, head_dim = query.shape
    q = query.view(n, k.shape[1], n_heads // k.shape[1], head_dim)  # [N, Hkv, G, D]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if softcap is None and sinks is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        sink = None if sinks is None else sinks.view(1, q.shape[1], q.shape[2], 1)  # [1, Hkv, G, 1]
        o = explicit_attention(q, k, v, mask, scale, softcap, sink)
    return o.reshape(n, n_heads, head_dim)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       scale: float | None, softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap), masked) v, the softmax in fp32 (as transformers'
    eager attention): `q` [..., G, D], `k`, `v` [..., L, D], `mask` broadcasting to [..., G, L].
    `sinks` (gpt-oss), broadcasting to [..., G, 1]: one more logit per head in each softmax,
    whose weight is dropped (it takes probability from the positions, adds no value)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    scores = torch.cat((scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)), dim=-1)  # [..., G, L+1]
    scores = scores - scores.amax(dim=-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


@dataclass(frozen=True, eq=False)
class MirrorRows:
    """One step's decode rows in the mirror: row `rows[i]` holds batch row `i`."""

    mirror: DecodeMirror
    rows: torch.Tensor  # [Nd] mirror row of each decode row
    order: torch.Tensor | None  # [Nd] decode row held by mirror rows 0..Nd-1; None when rows[i] == i
    dest: torch.Tensor  # [Nd] where each row's new token goes: row * Lcap + position
    slots: torch.Tensor  # [Nd] pool slot of each row's new token (written by the layer before attention)
    mask: torch.Tensor | None  # [Nd, 1, 1, max_len] in mirror order; None when every row is max_len long
    max_len: int
    lens: torch.Tensor | None = None  # [Nd] attended lengths in mirror order (windowed masks)
    masks: dict = field(default_factory=dict)  # window -> its mask, made once per step

    def window_mask(self, window: int | None) -> torch.Tensor | None:
        return step_mask(self, self.lens, window)

    def attend(self, query: torch.Tensor, kv: torch.Tensor, window: int | None = None, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the new tokens' K/V from the pool layer `kv` in, then attend over the rows (the last
        `window` positions of each, when it slides)."""
        _, hkv, nb, bs, d = kv.shape
        m = self.mirror.layer(kv)  # [2, Hkv, R, Lcap, D]
        new = kv.view(2 * hkv, nb * bs, d).index_select(1, self.slots)  # [2*Hkv, Nd, D]
        m.view(2 * hkv, -1, d).index_copy_(1, self.dest, new)
        n = self.rows.shape[0]
        k = m[0, :, :n, : self.max_len].transpose(0, 1)  # [Nd, Hkv, L, D], a view
        v = m[1, :, :n, : self.max_len].transpose(0, 1)
        mask = self.window_mask(window)
        if self.order is None:
            return attend_rows(query, k, v, mask, scale, softcap, sinks)
        out = attend_rows(query.index_select(0, self.order), k, v, mask, scale, softcap, sinks)
        return out.index_select(0, self.rows)


class DecodeMirror:
    """Rows of contiguous K/V for the sequences decoding now, over one `KVPool`."""

    def __init__(self, pool, rows: int = 8, positions: int = 256) -> None:
        self.pool = pool
        self.data = self._zeros(rows, min(positions, pool.max_tokens))  # [L, 2, Hkv, R, Lcap, D]
        self.keys: list[int] = []  # row -> sequence key
        self.held: list[int] = []  # row -> positions it holds (0 .. held-1)
        self.row_of: dict[int, int] = {}

    def _zeros(self, rows: int, positions: int) -> torch.Tensor:
        p = self.pool
        return torch.zeros((p.num_layers, 2, p.num_kv_heads, rows, positions, p.head_dim), dtype=p.dtype,
                           device=p.device)

    def layer(self, kv: torch.Tensor) -> torch.Tensor:
        """The mirror of the pool layer `kv` (a view of the pool's data): `[2, Hkv, R, Lcap, D]`."""
        return self.data[(kv.storage_offset() - self.pool.data.storage_offset()) // self.pool.data[0].numel()]

    def release(self, key: int) -> None:
        """Forget a sequence's row (it stopped decoding, or was preempted); the last row moves in."""
        row = self.row_of.pop(key, None)
        if row is None:
            return
        last = len(self.keys) - 1
        if row != last:
            held = self.held[last]
            self.data[:, :, :, row, :held] = self.data[:, :, :, last, :held]
            self.keys[row], self.held[row] = self.keys[last], held
            self.row_of[self.keys[row]] = row
        self.keys.pop()
        self.held.pop()

    def prepare(self, keys: Sequence[int], tables: Sequence[Sequence[int]], lens: Sequence[int],
                block_size: int) -> MirrorRows:
        """Rows for this step's decode rows (sequence `keys[i]` attends `lens[i]` positions through
        `tables[i]`), each holding every position but the new one, which `attend` copies in."""
        # 1. release the rows of sequences that are not decoding in this step
        wanted = set(keys)
        for key in [k for k in self.keys if k not in wanted]:
            self.release(key)
        # 2. room for every row and the longest one
        self._reserve(len(keys), max(lens))
        # 3. a new or stale row is filled from its blocks: every position before the new token
        rows = []
        for key, table, n in zip(keys, tables, lens, strict=True):
            row = self.row_of.get(key)
            if row is None:
                row = self.row_of[key] = len(self.keys)
                self.keys.append(key)
                self.held.append(0)
            if self.held[row] != n - 1:
                self._fill(row, table, n - 1, block_size)
            self.held[row] = n
            rows.append(row)
        return self._plan(rows, tables, lens, block_size)

    def _plan(self, rows: list[int], tables, lens, block_size: int) -> MirrorRows:
        device = self.data.device
        n, max_len = len(rows), max(lens)
        identity = rows == list(range(n))
        ordered = list(range(n)) if identity else sorted(range(n), key=rows.__getitem__)  # decode row of mirror row r
        slots = [t[(k - 1) // block_size] * block_size + (k - 1) % block_size
                 for t, k in zip(tables, lens, strict=True)]
        capacity = self.data.shape[4]
        dest = [r * capacity + k - 1 for r, k in zip(rows, lens, strict=True)]
        data = torch.tensor(rows + dest + slots + ordered + [lens[i] for i in ordered],
                            dtype=torch.int64, device=device)  # one copy, then views
        held = data[4 * n :]
        mask = row_mask(held, max_len, None) if min(lens) != max_len else None
        return MirrorRows(self, data[:n], None if identity else data[3 * n : 4 * n], data[n : 2 * n],
                          data[2 * n : 3 * n], mask, max_len, held)

    def _fill(self, row: int, table: Sequence[int], n: int, block_size: int) -> None:
        """Copy positions `0 .. n-1` of a sequence from its blocks, every layer at once."""
        if n == 0:
            return
        p = self.pool
        blocks = torch.tensor(table[: -(-n // block_size)], dtype=torch.int64, device=p.device)
        g = p.data.view(-1, p.num_blocks, block_size * p.head_dim).index_select(1, blocks)  # [L*2*Hkv, nb, B*D]
        self.data[:, :, :, row, :n] = g.view(p.num_layers, 2, p.num_kv_heads, -1, p.head_dim)[..., :n, :]

    def _reserve(self, rows: int, positions: int) -> None:
        """Grow (by doubling, keeping what rows hold) to at least `rows` x `positions`."""
        _, _, _, have_rows, have_positions, _ = self.data.shape
        if rows <= have_rows and positions <= have_positions:
            return
        new_rows = max(have_rows, 1 << (rows - 1).bit_length())
        new_positions = max(have_positions, min(1 << (positions - 1).bit_length(), self.pool.max_tokens))
        grown = self._zeros(new_rows, new_positions)
        held = max(self.held, default=0)
        grown[:, :, :, :have_rows, :held] = self.data[:, :, :, :, :held]
        self.data = grown
