"""A GGUF model's tensors under Hugging Face names, dequantized, as the loader reads a checkpoint.

Design: the loader asks for the Hugging Face tensors its family expects (workers/model/weights.py);
gguf-py's own `TensorNameMap` for the file's architecture names each of them in GGUF
(`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight`), so the map is llama.cpp's,
not a second copy. Each tensor is yielded as (file, GGUF name, HF name, shape, read): `read()`
dequantizes its bytes in torch (workers/gguf/dequant.py) to float32 and undoes what llama.cpp's
converter changed: q and k rows back in Hugging Face's rotary order (`PERMUTED_QK`), Gemma's
norms stored as 1 + w back to w (`NORM_PLUS_ONE`). A stacked experts tensor
(`blk.N.ffn_gate_exps.weight`, [experts, ...]) comes back as one entry per expert under that
expert's HF name, dequantized once. A tensor no expected name maps to comes back under its GGUF
name, for the loader to report as unexpected; a type we do not dequantize is a named error before
anything is read. A tensor the device keeps packed (workers/gguf/packed.py) is read as its bytes
instead, whole rows of blocks, its q/k rows moved as its values would be. Trade-off: the rest is
unpacked at load (the model's dtype), taking its dense size in memory.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from workers.gguf.config import NORM_PLUS_ONE, PERMUTED_QK
from workers.gguf.dequant import check_type, dequantize
from workers.gguf.files import GGUFError, metadata, open_readers


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k interleave: each head's rows (2, half) back from (half, 2)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_EXPERT = re.compile(r"^(?P<head>.+\.experts)\.(?P<e>\d+)\.(?P<tail>[^.]+)\.(?P<suffix>weight|bias)$")


def gguf_names(arch: str, num_layers: int, hf_names: list[str]) -> dict[str, str | dict[int, str]]:
    """GGUF name -> HF name for each of `hf_names` that llama.cpp's table for `arch` names; a stacked
    experts tensor (`blk.0.ffn_gate_exps.weight`) -> {expert: HF name of that expert's tensor}."""
    import gguf

    arch_id = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise GGUFError(f"gguf-py knows no architecture `{arch}`")
    table = gguf.get_tensor_name_map(arch_id, num_layers)
    out: dict[str, str | dict[int, str]] = {}
    for hf in hf_names:
        if m := _EXPERT.match(hf):  # one expert's tensor: GGUF stacks every expert's in one
            name = table.get_name(f"{m['head']}.{m['tail']}")
            if name is not None:
                stacked = out.setdefault(f"{name}.{m['suffix']}", {})
                assert isinstance(stacked, dict)
                stacked[int(m["e"])] = hf
            continue
        base, _, suffix = hf.rpartition(".")
        name = table.get_name(base)
        if name is not None:
            out[f"{name}.{suffix}"] = hf
    return out


def _reader(t, type_name: str, shape: tuple[int, ...], permute_heads: int | None,
            minus_one: bool) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:
        raw = torch.from_numpy(np.array(t.data, copy=True).reshape(-1).view(np.uint8))
        values = dequantize(raw, type_name, shape)
        if minus_one:  # a Gemma norm stored as 1 + w
            values = values - 1
        return unpermute_rows(values, permute_heads) if permute_heads else values
    return read


def _raw_reader(t, shape: tuple[int, ...], permute_heads: int | None) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:  # uint8 [rows, bytes per row]: whole rows of blocks, moved as the values would be
        raw = torch.from_numpy(np.array(t.data, copy=True).reshape(-1).view(np.uint8)).reshape(shape[0], -1)
        return unpermute_rows(raw, permute_heads) if permute_heads else raw
    return read


def _raw_stacked(t, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    def read() -> torch.Tensor:  # uint8 [E, rows, bytes per row]
        return torch.from_numpy(np.array(t.data, copy=True).reshape(-1).view(np.uint8)).reshape(shape[0], shape[1], -1)
    return read


def _expert(whole: Callable[[], torch.Tensor], e: int) -> torch.Tensor:
    return whole()[e]


def gguf_tensors(files: list[Path], expected: Mapping[str, tuple[int, ...]], num_heads: int, num_kv_heads: int,
                 packed: Callable[[str], bool] | None = None,
                 ) -> Iterator[tuple[str, str, str, tuple[int, ...], Callable[[], torch.Tensor]]]:  # fmt: skip
    """(file name, GGUF name, HF name, shape, read) of every tensor of the GGUF model in `files`; `read()`
    gives the HF names `packed` picks as their GGUF bytes (uint8 [rows, bytes per row]), not dequantized."""
    readers = open_readers(files)
    meta = metadata(readers[0])
    arch = meta["general.architecture"]
    layers = int(meta.get(f"{arch}.block_count", 0))
    names = gguf_names(arch, layers, list(expected))
    for reader in readers:
        for t in reader.tensors:
            check_type(t.tensor_type.name, t.name)
    for path, reader in zip(files, readers, strict=True):
        for t in reader.tensors:
            if t.name == "rope_freqs.weight":  # read into the config's rope scaling when prepared (rope_freqs.py)
                continue
            hf = names.get(t.name, t.name)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            heads = None
            if arch in PERMUTED_QK and (".attn_q." in t.name or ".attn_k." in t.name):
                heads = num_heads if ".attn_q." in t.name else num_kv_heads
            minus_one = arch in NORM_PLUS_ONE and t.name.endswith("norm.weight")
            if isinstance(hf, str) and packed is not None and packed(hf):  # kept packed (workers/gguf/packed.py)
                yield path.name, t.name, hf, shape, _raw_reader(t, shape, heads)
                continue
            read = _reader(t, t.tensor_type.name, shape, heads, minus_one)
            if isinstance(hf, dict) and packed is not None and packed(next(iter(hf.values()))):  # kept packed
                whole = functools.cache(_raw_stacked(t, shape))
                for e, name in sorted(hf.items()):
                    yield path.name, t.name, name, shape[1:], functools.partial(_expert, whole, e)
                continue
            if isinstance(hf, dict):  # stacked experts [E, ...]: one entry per expert, dequantized once
                whole = functools.cache(read)
                for e, name in sorted(hf.items()):
                    yield path.name, t.name, name, shape[1:], functools.partial(_expert, whole, e)
                continue
            yield path.name, t.name, hf, shape, read
