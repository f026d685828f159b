"""Decode rows that attend through their block tables: the compiled CPU step's attention.

Design: where the CPU decode kernel is loaded (`in_place`, kernels_local/paged_attention/cpu.py)
the rows read their blocks where they lie, one opaque op in the graph. Otherwise a compiled graph
has no mirror (a Python-side row map) and every row attends the same table width, so the rows'
blocks are read through their tables with explicit ops that Inductor fuses into one gather, a
whole block per table entry, then two batched matmuls with the mask and fp32 softmax between
them: the reference the kernel is held to. Trade-off of that fallback: the gathered K/V are
written once per layer and step (the matmuls cannot read through a table), and every row attends
the longest row's width, masked."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels_local.paged_attention.cpu import attend_in_place
from workers.kv.batch import DecodeRows


@dataclass(frozen=True, eq=False)
class PagedRows(DecodeRows):
    """Decode rows that attend in place through their block tables (the compiled CPU step):
    softmax(q k^T * scale) v over each row's positions `< seq_lens` (its last `window` ones when
    it slides), soft-capped where asked, with gpt-oss's sinks; scores and softmax in fp32."""

    def attend(self, query: torch.Tensor, kv: torch.Tensor, window: int | None = None, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.in_place:  # the C++ kernel reads the blocks where they lie (kernels_local/paged_attention)
            return attend_in_place(self, query, kv, window, softcap, scale, sinks)
        _, hkv, _, bs, d = kv.shape
        n, hq, _ = query.shape
        g = hq // hkv
        length = self.block_tables.shape[1] * bs
        pos = torch.arange(length, device=query.device)  # [L]
        # [Hkv, N, W, bs, D] -> [Hkv, N, L, D]: read through the table a whole block per index
        k = kv[0][:, self.block_tables].reshape(hkv, n, length, d)
        v = kv[1][:, self.block_tables].reshape(hkv, n, length, d)
        q = query.view(n, hkv, g, d).transpose(0, 1)  # [Hkv, N, G, D]
        # [Hkv, N, G, L]
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        seen = pos[None, :] < self.seq_lens[:, None]  # [N, L]
        if window is not None:
            seen &= pos[None, :] >= self.seq_lens[:, None] - window
        s = s.masked_fill(~seen[None, :, None, :], float("-inf"))
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:  # one more logit per head, whose weight is dropped
            sink = sinks.float().view(hkv, 1, g, 1).expand(hkv, n, g, 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :length]
        o = torch.matmul(p, v.float())  # [Hkv, N, G, D]
        return o.transpose(0, 1).reshape(n, hq, d).to(query.dtype)
