"""What crosses between a pipeline's stages, as integers and JSON: nothing is ever unpickled.

Design: a step's header is four int64 `[MAGIC, kind, n, rows]` (`header`, `read_header`); its
chunks are one int64 tensor of `n` values in a fixed layout (`encode_items`): the chunk count,
then per chunk its scalar fields and its tables' lengths, then its block table, its other groups'
tables and its token ids. `decode_items` reads them back checking every count against what is
left, every field against its range and the whole length, and refuses anything else with
`WireError`, so bytes that did not come from a stage (a stray connection, another program, an
older layout) are refused, never run. The stages' descriptions for `/workers` and their dtypes
cross as UTF-8 JSON and a dtype's index (`DTYPES`). Trade-off: the layout is explicit, so a new
`SeqChunk` field needs a line here; in exchange a stage holds nothing it did not declare.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from workers.kv.batch import SeqChunk

MAGIC = 0x68657473_0001  # "hets", layout 1
STEP, STOP = 0, 1
HEADER = 4  # int64 values: MAGIC, kind, values of the chunks, rows of hidden states
_FIXED = 9  # per chunk: start_pos, num_tokens, num_logits, has key, key, rope_len, state_slot, tables
DTYPES = ("float32", "float16", "bfloat16", "float64")


class WireError(ValueError):
    """A message between stages that is not in the stages' layout: what was wrong with it."""


def header(kind: int, n: int, rows: int) -> list[int]:
    return [MAGIC, kind, n, rows]


def read_header(values: Sequence[int], max_values: int = 1 << 31) -> tuple[int, int, int]:
    """(kind, values of the chunks, rows) of a header; `WireError` for anything else."""
    if len(values) != HEADER or values[0] != MAGIC:
        raise WireError(f"A pipeline message header must start with `{MAGIC:#x}`, got `{list(values)[:HEADER]}`: "
                        "not a message of this pipeline's stages")
    kind, n, rows = values[1:]
    if kind not in (STEP, STOP) or not 0 <= n <= max_values or not 0 <= rows <= max_values:
        raise WireError(f"A pipeline message header `{list(values)}` is out of range. Accepted: kind {STEP} (step) "
                        f"or {STOP} (stop), 0 to {max_values} values and rows")
    return kind, n, rows


def encode_items(items: Sequence[tuple[SeqChunk, Sequence[int]]]) -> list[int]:
    """A step's `(chunk, token ids)` pairs as int64 values in the layout `decode_items` reads."""
    out = [len(items)]
    for chunk, ids in items:
        key = chunk.key
        out += [chunk.start_pos, chunk.num_tokens, chunk.num_logits, 0 if key is None else 1,
                0 if key is None else key, chunk.rope_len, chunk.state_slot, len(chunk.block_table),
                len(chunk.group_tables)]
        out += [len(t) for t in chunk.group_tables]
        out += chunk.block_table
        for table in chunk.group_tables:
            out += table
        out += ids
    return out


class _Reader:
    def __init__(self, values: Sequence[int]):
        self.values, self.at = values, 0

    def take(self, n: int, what: str) -> list[int]:
        if n < 0 or self.at + n > len(self.values):
            raise WireError(f"A pipeline step message ends inside {what}: {n} values wanted at {self.at}, "
                            f"{len(self.values)} in all")
        self.at += n
        return list(self.values[self.at - n:self.at])


def _check(ok: bool, field: str, value) -> None:
    if not ok:
        raise WireError(f"A pipeline step message gives chunk field `{field}` the value `{value}`, out of its range")


def decode_items(values: Sequence[int]) -> list[tuple[SeqChunk, list[int]]]:
    """The `(chunk, token ids)` pairs `encode_items` wrote; `WireError` for anything else."""
    r = _Reader(values)
    (count,) = r.take(1, "the chunk count")
    _check(0 < count <= len(values), "count", count)
    items = []
    for _ in range(count):
        start, tokens, logits, has_key, key, rope, slot, n_blocks, n_groups = r.take(_FIXED, "a chunk's fields")
        for name, v, ok in (("start_pos", start, start >= 0), ("num_tokens", tokens, tokens >= 1),
                            ("num_logits", logits, 0 <= logits <= tokens), ("key", has_key, has_key in (0, 1)),
                            ("rope_len", rope, rope >= 0), ("state_slot", slot, slot >= -1),
                            ("block_table", n_blocks, n_blocks >= 0), ("group_tables", n_groups, n_groups >= 0)):
            _check(ok, name, v)
        lengths = r.take(n_groups, "the groups' table lengths")
        table = r.take(n_blocks, "a block table")
        groups = [r.take(n, "a group's block table") for n in lengths]
        ids = r.take(tokens, "token ids")
        _check(min(table + [b for g in groups for b in g], default=0) >= 0, "block ids", "negative")
        _check(min(ids) >= 0, "token ids", min(ids))
        items.append((SeqChunk(start, tokens, table, logits, key if has_key else None, rope, groups, slot), ids))
    if r.at != len(values):
        raise WireError(f"A pipeline step message carries {len(values) - r.at} values after its {count} chunks")
    return items


def encode_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(data: bytes):
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"A pipeline stage's description is not JSON: {e}") from e


def dtype_index(name: str) -> int:
    if name not in DTYPES:
        raise WireError(f"Compute dtype `{name}` cannot cross between stages. Accepted: {', '.join(DTYPES)}")
    return DTYPES.index(name)


def dtype_name(index: int) -> str:
    if not 0 <= index < len(DTYPES):
        raise WireError(f"A stage sent dtype index `{index}`. Accepted: 0 to {len(DTYPES) - 1} ({', '.join(DTYPES)})")
    return DTYPES[index]
