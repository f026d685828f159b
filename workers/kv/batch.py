"""The batch one `Transformer.step` runs: packed chunks of several sequences over block tables.

Design: `ForwardBatch.build` does all index bookkeeping once on the host (each token's position
and cache slot, which chunks decode as `DecodeRows` and which prefill as `PrefillSpan`s, which
rows become logits), so the model's step is only tensor work. Reading a sequence's K/V back from
blocks is a gather (`gather_kv`), a copy of every attended position per layer and step, so the
torch path avoids it where it can: through a `DecodeMirror`, or a strided view of the pool when
row `i`'s blocks are `first + i * stride + j` (`DecodeRows.view`). GPU kernels read the blocks
in place. Trade-off: the host builds every index tensor each step, Python work on the step's
critical path, so the model never branches on a sequence's layout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kernels_local.paged_attention.cpu import attend_in_place
from workers.kv.groups import first_needed
from workers.kv.mirror import DecodeMirror, MirrorRows, attend_rows, row_mask, step_mask
from workers.kv.state import StateBatch


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """A run of one sequence's tokens in a step: a prompt (or part of one) or one decode token."""

    start_pos: int  # position of the chunk's first token (tokens before it are in the cache)
    num_tokens: int
    block_table: Sequence[int]  # the sequence's blocks; must cover positions < start_pos + num_tokens
    num_logits: int = 1  # logits for this many of the chunk's last tokens (0: a prompt chunk mid-prompt)
    key: int | None = None  # the sequence's identity across steps (needed with a `DecodeMirror`)
    rope_len: int = 0  # its prompt's length, for rotaries that depend on it (workers/model/rope.py); 0: none
    # the other KV groups' tables (workers/kv/groups.py); (): `block_table` in every group
    group_tables: Sequence[Sequence[int]] = ()
    state_slot: int = -1  # its slot of the linear layers' state pool (workers/kv/state.py); -1: none


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """Where a multi-token chunk lies in the packed batch (host ints, no tensor sync)."""

    row_start: int  # first row of the chunk in the packed [T] tokens
    num_tokens: int
    start_pos: int
    # [1, nb] blocks holding positions base .. start_pos + num_tokens - 1; None when start_pos == 0
    blocks: torch.Tensor | None
    table: Sequence[int] = ()  # every block of the chunk's table as host ints (deterministic mode reads them all)
    base: int = 0  # position of `blocks`' first slot (a sliding group skips what its window cannot see)


def gather_kv(kv: torch.Tensor, tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[N, Hkv, length, D]` of `N` sequences from one layer's blocks `kv` `[2, Hkv, NB, B, D]`
    through `tables` `[N, MB]` (one copy: blocks and in-block offsets merge into positions)."""
    _, hkv, nb, bs, d = kv.shape
    n, mb = tables.shape
    g = kv.reshape(2 * hkv, nb, bs * d).index_select(1, tables.flatten())  # [2*Hkv, N*MB, B*D]
    g = g.view(2, hkv, n, mb * bs, d)[..., :length, :]  # [2, Hkv, N, length, D]
    return g[0].transpose(0, 1), g[1].transpose(0, 1)  # [N, Hkv, length, D] each


@dataclass(frozen=True, eq=False)
class DecodeRows:
    """The one-token chunks of a step, attended together over their block tables."""

    rows: torch.Tensor  # [Nd] rows of the packed batch
    rows_start: int | None  # first row when the rows are consecutive (slices, no gather/scatter)
    block_tables: torch.Tensor  # [Nd, MB] int64, padded with block 0
    seq_lens: torch.Tensor  # [Nd] int64, attended length (position + 1)
    max_len: int
    mask: torch.Tensor | None  # [Nd, 1, 1, max_len] bool; None when every row has length max_len
    view: tuple[int, int] | None  # (first block, blocks per row) when row i's blocks are first + i*stride + j
    mirror: MirrorRows | None = None  # the rows' K/V kept contiguous across steps (CPU engine)
    masks: dict = field(default_factory=dict)  # window -> its mask, made once per step
    # a sliding group's torch path: each row's blocks from the first its window reads [Nd, WB],
    # and its length counted from there [Nd]; None when the rows are short (or the group is full)
    window_tables: torch.Tensor | None = None
    window_lens: torch.Tensor | None = None
    in_place: bool = False  # CPU: attend through the tables with the C++ kernel (kernels_local/paged_attention)

    @property
    def num(self) -> int:
        return int(self.rows.shape[0])

    def window_mask(self, window: int | None) -> torch.Tensor | None:
        """The rows' mask when each attends only its last `window` positions (`mask` without one)."""
        return step_mask(self, self.seq_lens, window)

    def attend(self, query: torch.Tensor, kv: torch.Tensor, window: int | None = None, softcap: float | None = None,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The torch path: one query token per row `query` [Nd, Hq, D] over one layer's blocks `kv`
        [2, Hkv, NB, B, D] (this step's K/V already written) -> [Nd, Hq, D]; a sliding layer's
        rows see their last `window` positions, `softcap` caps the scores, `scale` scales them
        (default 1/sqrt(D)), `sinks` [Hq] join each row's softmax (gpt-oss)."""
        if self.in_place:
            return attend_in_place(self, query, kv, window, softcap, scale, sinks)
        if self.mirror is not None:
            return self.mirror.attend(query, kv, window, softcap, scale, sinks)
        if window is not None and self.window_tables is not None:  # only the blocks the window reads
            length = self.window_tables.shape[1] * kv.shape[3]
            k, v = gather_kv(kv, self.window_tables, length)  # [Nd, Hkv, WB*B, D] each
            return attend_rows(query, k, v, row_mask(self.window_lens, length, window), scale, softcap, sinks)
        k, v = self.gather(kv)  # [Nd, Hkv, L, D] each
        return attend_rows(query, k, v, self.window_mask(window), scale, softcap, sinks)

    def gather(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `[Nd, Hkv, max_len, D]` of every row: a strided view when `view` allows, else a gather."""
        _, hkv, nb, bs, d = kv.shape
        if self.view is not None and self.view[0] + self.num * self.view[1] <= nb:
            first, stride = self.view
            g = kv[:, :, first : first + self.num * stride].reshape(2, hkv, self.num, stride * bs, d)
            g = g[..., : self.max_len, :]  # [2, Hkv, Nd, L, D], a view
            return g[0].transpose(0, 1), g[1].transpose(0, 1)
        return gather_kv(kv, self.block_tables, self.max_len)


def _strided_view(tables: list[Sequence[int]]) -> tuple[int, int] | None:
    """(first, stride) when row i's blocks are `first + i * stride + j` with stride >= every row's
    block count; None otherwise (checked up to the first row that breaks it)."""
    first = tables[0][0]
    stride = tables[1][0] - first if len(tables) > 1 else len(tables[0])
    if stride < max(map(len, tables)):
        return None
    for i, table in enumerate(tables):
        start = first + i * stride
        if any(b != start + j for j, b in enumerate(table)):
            return None
    return first, stride


def _int64(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """Packed tokens of several chunks, with where each one's K/V go and come from."""

    input_ids: torch.Tensor  # [T] int64, chunks' tokens concatenated in chunk order
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, block * block_size + offset of each token
    logits_index: torch.Tensor  # [N] int64, rows projected to logits, in chunk order
    decode: DecodeRows | None
    prefills: tuple[PrefillSpan, ...]
    block_size: int
    max_pos: int  # largest position in the batch
    max_block: int  # largest block id the batch reads or writes
    rope_lens: torch.Tensor | None = None  # [T] int64, the length each token is rotated for; None: not needed
    groups: tuple[GroupBatch, ...] = ()  # the other KV groups' slots and reads (sliding layers)
    states: StateBatch | None = None  # the linear layers' state slots of the chunks (None: no such layers)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def group(self, index: int) -> ForwardBatch | GroupBatch:
        """KV group `index`'s side of the batch: its `slot_mapping`, `decode` and `prefills`."""
        return self if index == 0 else self.groups[index - 1]

    @classmethod
    def build(
        cls,
        items: Sequence[tuple[SeqChunk, Sequence[int]]],
        block_size: int,
        device: torch.device | str = "cpu",
        mirror: DecodeMirror | None = None,
        windows: Sequence[int | None] = (None,),
        in_place: bool = False,
    ) -> ForwardBatch:
        """Pack `(chunk, token ids)` pairs; `len(ids)` must equal `chunk.num_tokens`. With a
        `mirror`, decode rows (whose chunks must carry a `key`) are attended from it; `in_place`,
        through their tables by the CPU kernel (kernels_local/paged_attention/cpu.py; then no mirror).
        `windows`: each KV group's window (the chunks carry the other groups' tables), so a
        sliding group reads only what its window sees."""
        if in_place and mirror is not None:
            raise ValueError("Decode rows read in place need no DecodeMirror: give one or the other")
        if not items:
            raise ValueError("A ForwardBatch needs at least one chunk, got `0`")
        bs, window = block_size, windows[0]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_index: list[int] = []
        dec_rows: list[int] = []
        dec_tables: list[Sequence[int]] = []
        dec_lens: list[int] = []
        dec_keys: list[int | None] = []
        prefills: list[PrefillSpan] = []
        max_block = 0
        rope = [(c.rope_len, c.num_tokens) for c, _ in items] if any(c.rope_len for c, _ in items) else None
        # 1. Lay the chunks out one after the other: each token's slot, each chunk's role.
        for chunk, tokens in items:
            start, n = chunk.start_pos, chunk.num_tokens
            end = start + n
            if (n == 1 and len(tokens) == 1 and start >= 0 and chunk.num_logits in (0, 1)
                    and len(chunk.block_table) > start // bs):
                # a decode token (the common case, kept short): earlier positions went through
                # the same table in earlier steps, so only the block written now is checked
                row, used = len(ids), start // bs + 1
                block = chunk.block_table[used - 1]
                max_block = max(max_block, block)
                ids.append(tokens[0])
                positions.append(start)
                slots.append(block * bs + start % bs)
                if chunk.num_logits == 1:
                    logits_index.append(row)
                dec_rows.append(row)
                dec_tables.append(chunk.block_table[:used])
                dec_lens.append(end)
                dec_keys.append(chunk.key)
                continue
            if n < 1 or len(tokens) != n or start < 0 or not 0 <= chunk.num_logits <= n:
                raise ValueError(
                    f"Chunk `{chunk}` carries `{len(tokens)}` tokens; it needs start_pos >= 0, "
                    f"num_tokens == len(tokens) >= 1 and 0 <= num_logits <= num_tokens"
                )
            used = -(-end // bs)
            if len(chunk.block_table) < used:
                raise ValueError(
                    f"Chunk ending at position {end} needs {used} blocks of {bs} tokens, its block "
                    f"table has `{len(chunk.block_table)}`"
                )
            table = chunk.block_table[:used]
            max_block = max(max_block, max(table))
            row = len(ids)
            ids.extend(tokens)
            positions.extend(range(start, end))
            for b in range(start // bs, used):  # the chunk's positions, block by block
                base = table[b] * bs - b * bs
                slots.extend(range(base + max(start, b * bs), base + min(end, (b + 1) * bs)))
            logits_index.extend(range(row + n - chunk.num_logits, row + n))
            if n == 1:
                dec_rows.append(row)
                dec_tables.append(table)
                dec_lens.append(end)
                dec_keys.append(chunk.key)
            else:
                first = first_needed(window, start, bs) if start > 0 else 0
                blocks = _int64([table[first:]], device) if start > 0 else None
                prefills.append(PrefillSpan(row, n, start, blocks, table, first * bs))
        # 2. Every index list in one host -> device copy, then views of it.
        n_tok, n_log, n_dec = len(ids), len(logits_index), len(dec_rows)
        flat = ids + positions + slots + logits_index
        if n_dec:
            width = -(-max(dec_lens) // bs)
            flat += dec_rows + dec_lens
            for t in dec_tables:  # block tables padded with block 0
                flat.extend(t)
                flat.extend([0] * (width - len(t)))
        if rope is not None:
            flat += [length for length, n in rope for _ in range(n)]
        data = torch.tensor(flat, dtype=torch.int64, device=device)
        cut = n_tok * 3 + n_log
        rope_lens = None
        if rope is not None:  # each token: max(position + 1, its prompt's length)
            rope_lens = torch.maximum(data[n_tok : 2 * n_tok] + 1, data[-n_tok:])
        # 3. Decode rows: the mask and the copy-free view serve the torch path without a mirror.
        decode = None
        if n_dec:
            max_len = max(dec_lens)
            lens = data[cut + n_dec : cut + 2 * n_dec]
            mask, view = None, None
            gathers = mirror is None and not in_place  # the torch path reading the pool itself
            if gathers:
                view = _strided_view(dec_tables)
                if min(dec_lens) != max_len:
                    mask = row_mask(lens, max_len, None)  # [Nd, 1, 1, L]
            elif mirror is not None and None in dec_keys:
                raise ValueError("Decode chunks need a `key` when the batch uses a DecodeMirror")
            wt, wl = _window_rows(dec_tables, dec_lens, window if gathers else None, bs, device)
            decode = DecodeRows(
                rows=data[cut : cut + n_dec],
                rows_start=dec_rows[0] if dec_rows[-1] - dec_rows[0] == n_dec - 1 else None,
                block_tables=data[cut + 2 * n_dec : cut + (2 + width) * n_dec].view(n_dec, width),
                seq_lens=lens, max_len=max_len, mask=mask, view=view,
                mirror=None if mirror is None else mirror.prepare(dec_keys, dec_tables, dec_lens, bs),
                window_tables=wt, window_lens=wl, in_place=in_place,
            )
        groups = tuple(_group_batch(items, g, w, bs, device, decode) for g, w in enumerate(windows[1:], 1))
        return cls(
            input_ids=data[:n_tok],
            positions=data[n_tok : 2 * n_tok],
            slot_mapping=data[2 * n_tok : 3 * n_tok],
            logits_index=data[3 * n_tok : cut],
            decode=decode,
            prefills=tuple(prefills),
            block_size=bs,
            max_pos=max(positions),
            max_block=max_block,
            rope_lens=rope_lens,
            groups=groups,
            states=StateBatch.build([c for c, _ in items], device),
        )


@dataclass(frozen=True, eq=False)
class GroupBatch:
    """Another KV group's side of a `ForwardBatch`: the same tokens, through that group's tables."""

    slot_mapping: torch.Tensor  # [T] int64
    decode: DecodeRows | None  # the same rows, lengths and masks, the group's own tables
    prefills: tuple[PrefillSpan, ...]
    max_block: int


def _window_rows(tables: list[Sequence[int]], lens: list[int], window: int | None, bs: int,
                 device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A sliding group's decode rows cut to what the window reads: each row's blocks from its
    first visible one [Nd, WB] and its length counted from there [Nd]; (None, None) when no row
    is longer than the window and a block (the full tables are as short)."""
    if window is None or max(lens) <= window + bs:
        return None, None
    firsts = [first_needed(window, n - 1, bs) for n in lens]
    width = max(-(-n // bs) - f for n, f in zip(lens, firsts, strict=True))
    flat: list[int] = []
    for t, n, f in zip(tables, lens, firsts, strict=True):
        row = t[f : -(-n // bs)]
        flat.extend(row)
        flat.extend([0] * (width - len(row)))
    flat.extend(n - f * bs for n, f in zip(lens, firsts, strict=True))
    data = _int64(flat, device)
    return data[: -len(lens)].view(len(lens), width), data[-len(lens) :]


def _group_batch(items: Sequence[tuple[SeqChunk, Sequence[int]]], g: int, window: int | None, bs: int, device,
                 decode: DecodeRows | None) -> GroupBatch:
    """Group `g`'s slots, decode tables and prefill spans for the chunks of a batch."""
    slots: list[int] = []
    tables: list[Sequence[int]] = []
    lens: list[int] = []
    prefills: list[PrefillSpan] = []
    row = max_block = 0
    for chunk, _ in items:
        if chunk.group_tables and len(chunk.group_tables) < g:
            raise ValueError(f"Chunk `{chunk}` carries no block table of KV group `{g}`")
        # no tables of the other groups: the same block ids in each (a pool whose groups are alike)
        table = chunk.group_tables[g - 1] if chunk.group_tables else chunk.block_table
        start, n = chunk.start_pos, chunk.num_tokens
        end = start + n
        used = -(-end // bs)
        if len(table) < used:
            raise ValueError(f"Chunk ending at position {end} needs {used} blocks of KV group {g}, its table has "
                             f"`{len(table)}`")
        first = first_needed(window, start, bs)
        max_block = max(max_block, *table[first:used])
        for b in range(start // bs, used):
            base = table[b] * bs - b * bs
            slots.extend(range(base + max(start, b * bs), base + min(end, (b + 1) * bs)))
        if n == 1:
            tables.append(table[:used])
            lens.append(end)
        else:
            blocks = _int64([table[first:used]], device) if start > 0 else None
            prefills.append(PrefillSpan(row, n, start, blocks, table[:used], first * bs if start > 0 else 0))
        row += n
    rows = None
    if decode is not None:
        width = decode.block_tables.shape[1]
        flat = [b for t in tables for b in (*t, *([0] * (width - len(t))))]
        wt, wl = _window_rows(tables, lens, None if decode.in_place else window, bs, device)
        mask = decode.mask if decode.mirror is None else (
            row_mask(decode.seq_lens, decode.max_len, None) if min(lens) != decode.max_len else None)
        rows = replace(decode, block_tables=_int64(flat, device).view(len(tables), width), mask=mask,
                       view=_strided_view(tables), mirror=None, masks={}, window_tables=wt, window_lens=wl)
    return GroupBatch(_int64(slots, device), rows, tuple(prefills), max_block)
