"""The LoRA delta of a mixed batch: each row of a step carries an adapter (or the base), and every
targeted projection adds its adapter's low-rank product to that row's output.

Design: `install_lora` puts one forward hook on each projection an adapter may target (q/k/v in
`wqkv`, `wo`, `w_gate_up`, `w_down`); a hook runs after whatever forward the layer has (torch, a
kernel, an fp8 or packed CPU projection), so the base path is untouched. A step announces its rows
with `lora_rows(model, batch)`, a `LoraBatch` of (adapter, row indices) groups; the hook hands the
projection's input and output to the model's one `LoraDelta` module, a kernel layer like the
others (kernelized with the model's plan): its torch forward, `add_lora`, loops over the adapters
present, gathers their rows (`index_select`), multiplies `(x @ A^T) @ B^T * scale` and adds it back
in place (`index_add_` on the columns of the target's part): the CPU path and the reference. On a
GPU the chosen Triton layer (kernels_local/lora_sgmv/) does the same for every adapter of the step
in one shrink and one expand launch, over the adapters stacked per projection (workers/lora/
pool.py: the worker's slots, read in place) and the batch's rows gathered into one segment per
adapter. Outside `lora_rows` the hook returns at once. Trade-off: the compiled decode step does
not trace the hooks, so a step holding any adapter row runs eager (workers/engine/runner.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from kernels import use_kernel_forward_from_hub
from torch import nn

from kernels_local.lora_sgmv.lora_sgmv import LoraSegments, LoraStack
from workers.lora.adapter import TARGETS, LoraAdapter, is_projection
from workers.lora.experts import hook_experts
from workers.lora.pool import LoraPool, add_pooled, pooled_fits
from workers.lora.stack import StackCache

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

    @property
    def adapters(self) -> tuple[LoraAdapter, ...]:
        return tuple(a for a, _ in self.groups)

    @property
    def pooled(self) -> bool:
        """Whether every adapter sits in a pool slot (the kernel reads the pool, not a stack of the step)."""
        return all(a.slot is not None for a, _ in self.groups)

    @cached_property
    def row_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The segments' rows (int64) and each one's pool slot (int64), for the pooled torch path."""
        seg = self.segments
        return seg.rows.long(), torch.repeat_interleave(seg.loras.long(), seg.starts.diff().long())

    @cached_property
    def segments(self) -> LoraSegments:
        """The rows gathered into one segment per adapter, for the kernel: each segment's slot is its
        adapter's pool slot when every adapter has one, else its group (a stack of this batch's)."""
        slots = [a.slot for a, _ in self.groups] if self.pooled else list(range(len(self.groups)))
        return LoraSegments.from_groups([rows for _, rows in self.groups], slots)


@use_kernel_forward_from_hub("LoraDelta")
class LoraDelta(nn.Module):
    """`forward(name, x, out, batch)`: `out += ` the LoRA delta of `batch`'s adapters on projection
    `name`, in place; the torch path here, a kernel where the model's plan chose one."""

    def __init__(self) -> None:
        super().__init__()
        self.stacks = StackCache()
        self.pool: LoraPool | None = None  # the worker's slots (workers/lora/pool.py), set with its table

    def forward(self, name: str, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
        return self.torch_delta(name, x, out, batch)

    def torch_delta(self, name: str, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
        if self.pool is not None and batch.pooled and len(batch.groups) > 1:
            packed = self.stacked(name, batch, x.device)
            if packed is None:
                return  # no adapter of the step targets this projection
            if pooled_fits(*packed):
                add_pooled(packed[0], *batch.row_slots, x, out)
                return
        add_lora(name, x, out, batch)

    def stacked(self, name: str, batch: LoraBatch, device) -> tuple[LoraStack, LoraSegments] | None:
        """Projection `name`'s stack of the batch's adapters and the batch's segments (None: no adapter
        of the batch targets it): what a kernel layer launches on. Adapters in the pool are read there
        in place; others (read, not placed: a check before the pool holds them) get a stack built."""
        if self.pool is not None and batch.pooled:
            if not any(name in a.targets for a in batch.adapters):
                return None
            stack = self.pool.stack(name)
            return None if stack is None else (stack, batch.segments)
        stack = self.stacks.get(batch.adapters, name, device)
        return None if stack is None else (stack, batch.segments)


class _State:
    """The batch the hooks read (set by `lora_rows` for the length of one forward) and the delta."""

    batch: LoraBatch | None = None

    def __init__(self, delta: LoraDelta) -> None:
        self.delta = delta


def install_lora(model: nn.Module) -> int:
    """Hook every projection an adapter may target (once per model); the number hooked. The delta
    gets the model's kernel plan when it has one (workers/kernelize/apply.py `model.kernel_plan`)."""
    if getattr(model, "lora_state", None) is not None:
        return 0
    delta = LoraDelta()
    plan = getattr(model, "kernel_plan", None)
    if plan is not None:
        plan.apply(delta)
    state = _State(delta)
    model.lora_state = state
    count = 0
    for name, module in model.named_modules():
        if is_projection(module) and name.rsplit(".", 1)[-1] in HOOKED:  # fp8, int4 and GGUF layers too
            module.register_forward_hook(_hook(name, state))
            count += 1
    return count + hook_experts(model, state)


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
        whole = len(rows) == x2.shape[0]  # one adapter on every row: no gather, no scatter
        xs = x2 if whole else x2.index_select(0, rows)  # [n, K]
        for t in pairs:
            xs_t = xs.to(t.a.dtype)
            delta = ((xs_t @ t.a.T) @ t.b.T) * adapter.scale  # [n, r] -> [n, size]
            part = out2.narrow(1, t.offset, t.size)
            if whole:
                part.add_(delta.to(out2.dtype))
            else:
                part.index_add_(0, rows, delta.to(out2.dtype))


def _hook(name: str, state: _State):
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        batch = state.batch
        if batch is not None:
            state.delta.forward(name, args[0], out, batch)  # the chosen forward, without Module.__call__

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
