"""Reading a GGUF file's blocks into packed layers, on a device whose GGUF rule keeps them packed.

Design: driven by the loader through the calls every quantized checkpoint's reader answers
(workers/quant/checkpoint.py): `bind`, `claims`, `covers`, `to_ours`, `install`. At `bind` the
tensor table (no data) says each tensor's type, and one decision is made per module of ours: a
plain `nn.Linear` whose GGUF tensors (all its fused parts) are of a type the kernel decodes
(the device rule's `types`) keeps them packed, and on the CPU a head tied to the embedding keeps the
embedding's blocks, which the embedding then reads too (workers/gguf/embedding.py); anything else
(norms, embeddings, a tied head elsewhere, F16/BF16 matrices, MXFP4, a fused module with one float
part) is dequantized at load as before. `claims`
names the tensors the loader then reads as bytes (workers/gguf/weights.py `gguf_tensors`, which
puts Llama's q/k rows back in rotary order by moving whole rows of blocks), `to_ours` concatenates a
fused module's parts that share a type and `install` swaps in `GGUFLinear` (one type) or
`GGUFFusedLinear` (several); a MoE layer whose gate, up and down experts are all of kept types becomes
a `GGUFExperts` holding each projection's experts stacked as the file stacks them. Trade-off: a fused
module of two types takes one launch per type run instead of one, for keeping every tensor's own bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from kernels_local.gguf_linear.cpu import TYPES as CPU_TYPES
from workers.gguf.embedding import GGUFEmbedding
from workers.gguf.execution import PACKED_TYPES, gguf_rule
from workers.gguf.experts import ACTIVATIONS, GGUFExperts
from workers.gguf.files import GGUFError, metadata, open_readers, tensor_infos
from workers.gguf.linear import GGUFFusedLinear, GGUFLinear, row_bytes, type_runs
from workers.gguf.weights import gguf_names

logger = logging.getLogger(__name__)


class PackedGGUF:
    """The GGUF tensors of one model that a device keeps packed, and the layers that hold them."""

    def __init__(self, files: list[Path], map_name: Callable[[str], tuple[str, object] | None],
                 types: tuple[str, ...] = PACKED_TYPES, tied_head: bool = False) -> None:  # fmt: skip
        self.files, self.map_name, self.kept = files, map_name, types  # `kept`: the types held packed
        self.tied_head = tied_head  # a tied head may keep the embedding's blocks (workers/gguf/embedding.py)
        self.tied: str | None = None  # the HF embedding tensor the packed head and the embedding share
        self.types: dict[str, str] = {}  # HF tensor -> its GGUF type
        self.packed: dict[str, tuple[str, int]] = {}  # HF tensor kept packed -> (our module, its part)
        self.modules: dict[str, list[tuple[int, str]]] = {}  # our module -> [(part, HF tensor)] kept packed
        self.expected: dict[str, tuple[int, ...]] = {}
        self.specs: dict[str, tuple[int, list[tuple[str, int]]]] = {}  # module -> (K, runs), to_ours
        self.experts: dict[str, dict[tuple[int, int], str]] = {}  # experts kept packed: {(e, 0 gate|1 up|2 down)}
        self.expert_specs: dict[str, tuple[int, int, tuple[str, str, str]]] = {}  # (H, I, gate/up/down types)

    def bind(self, model: nn.Module, expected: dict[str, tuple[int, ...]]) -> None:
        """Decide, module by module, which of `model`'s linear layers keep their GGUF blocks."""
        self.expected = dict(expected)
        readers = open_readers(self.files)
        meta = metadata(readers[0])
        arch = meta["general.architecture"]
        names = gguf_names(arch, int(meta.get(f"{arch}.block_count", 0)), list(expected))
        infos = tensor_infos(readers)
        for g, hf in names.items():
            if g in infos:  # a stacked experts tensor: each expert's HF tensor has its type
                self.types |= {h: infos[g].type_name for h in (hf.values() if isinstance(hf, dict) else (hf,))}
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        candidates: dict[str, list[tuple[int, str]]] = {}
        experts: dict[str, dict[tuple[int, int], str]] = {}  # experts module -> {(expert, piece): HF tensor}
        for hf, shape in expected.items():
            mapped = self.map_name(hf) if hf.endswith(".weight") and len(shape) == 2 else None
            if mapped is not None and isinstance(mapped[1], tuple) and len(mapped[1]) == 3:  # one expert's piece
                head, _, leaf = mapped[0].rpartition(".")
                piece = 2 if leaf == "w_down" else (mapped[1][2] or 0)
                experts.setdefault(head, {})[(mapped[1][1], piece)] = hf
                continue
            if mapped is None or not mapped[0].endswith(".weight") or not (mapped[1] is None
                                                                          or isinstance(mapped[1], int)):
                continue  # not a linear weight of ours (experts, layouts)
            ours = mapped[0].removesuffix(".weight")
            if type(model.get_submodule(ours)) is not nn.Linear or (ours == "output" and tied):
                continue
            candidates.setdefault(ours, []).append((mapped[1] or 0, hf))
        if tied and self.tied_head:
            candidates |= self._tied_candidate(model, expected)
        for ours, parts in candidates.items():
            if all(self.types.get(hf) in self.kept for _, hf in parts):
                self.modules[ours] = sorted(parts)
                self.packed |= {hf: (ours, part) for part, hf in parts}
        for head, pieces in experts.items():
            m = model.get_submodule(head)
            whole = {(e, p) for e in range(getattr(m, "num_experts", 0)) for p in range(3)}
            if (type(m).__name__ == "FusedMoE" and m.b_gate_up is None and m.activation in ACTIVATIONS
                    and set(pieces) == whole and all(self.types.get(hf) in self.kept for hf in pieces.values())):
                self.experts[head] = pieces
                self.packed |= {hf: (head, e) for (e, _), hf in pieces.items()}

    def _tied_candidate(self, model: nn.Module, expected: dict[str, tuple[int, ...]]) -> dict[str, list]:
        """{"output": [(0, the HF embedding)]} where the head tied to it can read its blocks (a stage with the
        head and a plain embedding, of a type the CPU decoder reads), else {}."""
        if not (type(getattr(model, "output", None)) is nn.Linear
                and type(getattr(model, "tok_embeddings", None)) is nn.Embedding):
            return {}
        hf = next((h for h in expected if (m := self.map_name(h)) is not None and m[0] == "tok_embeddings.weight"),
                  None)
        if hf is None or self.types.get(hf) not in CPU_TYPES:
            return {}
        self.tied = hf
        return {"output": [(0, hf)]}

    def claims(self, name: str) -> bool:
        """Whether HF tensor `name` is read as its GGUF bytes (handed to `to_ours` as stored)."""
        return name in self.packed

    def covers(self, name: str) -> bool:
        return name in self.packed

    def to_ours(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our state-dict entries of the packed modules: `<module>.qweight`, or `<module>.parts.<i>.qweight`
        per run of parts sharing a type."""
        out: dict[str, torch.Tensor] = {}
        for ours, parts in self.modules.items():
            if not any(hf in stored for _, hf in parts):
                continue  # another pipeline stage's module
            blocks, typed = [], []
            for _, hf in parts:
                if hf not in stored:
                    raise GGUFError(f"`{ours}` keeps its GGUF blocks but the file has no `{hf}`")
                blocks.append(self._blocks(stored, hf))
                typed.append((self.types[hf], self.expected[hf][0]))
            groups: list[tuple[str, list[torch.Tensor]]] = []  # consecutive parts sharing a type
            for t, (type_name, _) in zip(blocks, typed, strict=True):
                if groups and groups[-1][0] == type_name:
                    groups[-1][1].append(t)
                else:
                    groups.append((type_name, [t]))
            self.specs[ours] = (self.expected[parts[0][1]][1], type_runs(typed))
            for i, (_, run) in enumerate(groups):
                key = f"{ours}.qweight" if len(groups) == 1 else f"{ours}.parts.{i}.qweight"
                out[key] = torch.cat(run) if len(run) > 1 else run[0]
        if self.tied is not None and "output.qweight" in out:
            out["tok_embeddings.qweight"] = out["output.qweight"]  # one tensor, not a copy
        for head, pieces in self.experts.items():
            if not all(hf in stored for hf in pieces.values()):
                continue  # another pipeline stage's layer
            (intermediate, hidden), count = self.expected[pieces[(0, 0)]], len(pieces) // 3
            for p, name in enumerate(("gate", "up", "down")):
                out[f"{head}.{name}_qweight"] = torch.stack([self._blocks(stored, pieces[(e, p)])
                                                             for e in range(count)])  # [E, rows, bytes]
            self.expert_specs[head] = (hidden, intermediate, tuple(self.types[pieces[(0, p)]] for p in range(3)))
        return out

    def _blocks(self, stored: dict[str, torch.Tensor], hf: str) -> torch.Tensor:
        """HF tensor `hf`'s GGUF bytes, checked against the rows of blocks its expected shape needs."""
        (rows, k), t, type_name = self.expected[hf], stored[hf], self.types[hf]
        if tuple(t.shape) != (rows, row_bytes(type_name, k)):
            raise GGUFError(f"GGUF tensor for `{hf}` ({type_name}) holds {tuple(t.shape)} bytes; the config "
                            f"expects {rows} rows of {row_bytes(type_name, k)} for shape {(rows, k)}")
        return t

    def install(self, model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> int:
        """Swap each packed module of ours (built on meta) for its GGUF layer; how many."""
        for ours, (k, runs) in self.specs.items():
            parent_name, _, attr = ours.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, attr)
            bias, dtype = old.bias is not None, old.weight.dtype
            if len(runs) == 1:
                layer = GGUFLinear(k, runs[0][1], runs[0][0], bias=bias, dtype=dtype, device="meta")
            else:
                layer = GGUFFusedLinear(k, runs, bias=bias, dtype=dtype, device="meta")
            setattr(parent, attr, layer)
        if self.tied is not None and "output" in self.specs:
            old = model.tok_embeddings
            model.tok_embeddings = GGUFEmbedding(old.num_embeddings, old.embedding_dim, self.types[self.tied],
                                                 dtype=old.weight.dtype)
        for head, (hidden, intermediate, types) in self.expert_specs.items():
            parent_name, _, attr = head.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, attr)
            setattr(parent, attr, GGUFExperts(old.num_experts, hidden, intermediate, types, old.activation,
                                              device="meta"))
        logger.info("GGUF blocks kept packed in %d layers and %d experts layers", len(self.specs),
                    len(self.expert_specs))
        return len(self.specs) + len(self.expert_specs)


def packed_gguf(files: list[Path] | None, map_name, device_type: str, capability) -> PackedGGUF | None:
    """The reader keeping a GGUF model's blocks packed on a device whose rule says so; None for a model
    that is no GGUF file or a device that dequantizes at load."""
    if files is None:
        return None
    rule = gguf_rule(device_type, capability)
    return PackedGGUF(files, map_name, rule.types, tied_head=device_type == "cpu") if rule.execution == "packed" \
        else None
