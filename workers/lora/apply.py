"""The LoRA delta of a mixed batch: each row of a step carries an adapter (or the base), and every
targeted projection adds its adapter's low-rank product to that row's output.

Design: `install_lora` puts one forward hook on each projection an adapter may target (q/k/v in
`wqkv`, `wo`, `w_gate_up`, `w_down`); a hook runs after whatever forward the layer has (torch, a
kernel, an fp8 or packed CPU projection), so the base path is untouched. A step announces its rows
with `lora_rows(model, batch)`, a `LoraBatch` of (adapter, row indices) groups; the hook loops over
the adapters present, gathers their rows (`index_select`), multiplies `(x @ A^T) @ B^T * scale`
and adds it back in place (`index_add_` on the columns of the target's part). Outside `lora_rows`
the hook returns at once. Trade-off: one gather, two thin matmuls and a scatter per adapter and
projection, in Python: fine for a few adapters per step on the CPU torch path and the reference
for a segmented kernel (SGMV/BGMV) that would do it in one launch per projection; the compiled
decode step does not trace the hooks, so a step holding any adapter row runs eager
(workers/engine/runner.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from workers.lora.adapter import TARGETS, LoraAdapter

HOOKED = frozenset(TARGETS.values())


@dataclass(frozen=True, eq=False)
class LoraBatch:
    """The adapters of one forward's rows: (adapter, row indices [n] int64) per adapter present."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor], ...]

    @classmethod
    def from_rows(cls, adapters: Sequence[LoraAdapter | None], device: str | torch.device = "cpu") -> LoraBatch | None:
        """From each row's adapter (None: the base model), in row order; None when no row has one."""
        rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for i, adapter in enumerate(adapters):
            if adapter is not None:
                rows.setdefault(id(adapter), (adapter, []))[1].append(i)
        if not rows:
            return None
        return cls(tuple((a, torch.tensor(r, dtype=torch.int64, device=device)) for a, r in rows.values()))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a, _ in self.groups)


class _State:
    """The batch the hooks read: set by `lora_rows` for the length of one forward."""

    batch: LoraBatch | None = None


def install_lora(model: nn.Module) -> int:
    """Hook every projection an adapter may target (once per model); the number hooked."""
    if getattr(model, "lora_state", None) is not None:
        return 0
    state = _State()
    model.lora_state = state
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in HOOKED:
            module.register_forward_hook(_hook(name, state))
            count += 1
    return count


@contextlib.contextmanager
def lora_rows(model: nn.Module, batch: LoraBatch | None) -> Iterator[None]:
    """Within it, `model`'s forwards add `batch`'s adapters to their rows (None: the base only)."""
    state = getattr(model, "lora_state", None)
    if batch is None:
        yield
        return
    if state is None:
        raise RuntimeError("LoRA rows given to a model without LoRA hooks (call `install_lora` first)")
    state.batch = batch
    try:
        yield
    finally:
        state.batch = None


def add_lora(name: str, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
    """`out[rows, part] += scale * (x[rows] @ A^T) @ B^T` for each adapter of `batch` that targets
    module `name`, in place: x [..., K], out [..., N] with the same leading rows."""
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # [R, K], [R, N]
    for adapter, rows in batch.groups:
        pairs = adapter.targets.get(name)
        if not pairs:
            continue
        xs = x2.index_select(0, rows)  # [n, K]
        for t in pairs:
            xs_t = xs.to(t.a.dtype)
            delta = ((xs_t @ t.a.T) @ t.b.T) * adapter.scale  # [n, r] -> [n, size]
            out2.narrow(1, t.offset, t.size).index_add_(0, rows, delta.to(out2.dtype))


def _hook(name: str, state: _State):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        batch = state.batch
        if batch is not None:
            add_lora(name, args[0], out, batch)

    return hook


def step_lora(chunks, device: str | torch.device = "cpu") -> LoraBatch | None:
    """The LoRA rows of one step's packed chunks (chunk `i`'s tokens follow chunk `i - 1`'s), from
    each chunk's sequence's adapter; None when no chunk has one (the base model only)."""
    if all(c.seq.lora is None for c in chunks):
        return None
    return LoraBatch.from_rows([c.seq.lora for c in chunks for _ in range(len(c.token_ids))], device)


def lora_key(adapter: LoraAdapter | None) -> tuple[str, ...]:
    """What a sequence's prefix-cache root mixes in for its adapter (nothing for the base model):
    its name and the identity of the files it was read from, so no block is shared across adapters."""
    return () if adapter is None else ("lora", adapter.name, adapter.identity)
