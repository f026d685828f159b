"""The pipeline's wire: one `torch.distributed` process group per replica, stage to stage.

Design: stage `r` sends stage `r + 1` each step a header and the step's chunks as int64 values
(workers/pipeline/wire.py: a fixed layout of the `(SeqChunk, token ids)` pairs, so every stage
builds the same batch; a message in any other layout is refused, nothing is unpickled) and the
hidden states `[T, H]` in the compute dtype; the last stage sends the logits back in its compute
dtype, which the first makes fp32 (the cast a single worker makes, at half the bytes). Sends do
not wait for the receiver (`isend`); no fp8 and no sampling state crosses. The stages meet through
a file store of this start and bind their sockets to the plan's host
(workers/pipeline/rendezvous.py). The backend is the plan's (server/fleet/pipelines.py
`backend_for`): NCCL (RCCL) when every stage is a real GPU of one vendor, gloo through host memory
otherwise. Trade-off: a step's chunks are encoded on every hop rather than kept as state on each
stage, so a stage holds no scheduler state and a restarted pipeline has nothing to reconcile."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.contract.pipeline import PipelinePlan
from workers.pipeline import wire as layout
from workers.pipeline.rendezvous import Rendezvous, bind_interface
from workers.pipeline.wire import STEP, STOP

logger = logging.getLogger(__name__)


@dataclass
class StageLink:
    """This stage's place in the process group and its neighbours."""

    rank: int
    world: int
    device: torch.device
    wire: torch.device  # where tensors must be to be sent: the device (NCCL) or the host (gloo)
    dtypes: list[torch.dtype]  # each stage's compute dtype

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    # ---- setup ----------------------------------------------------------------------------
    @classmethod
    def join(cls, plan: PipelinePlan, rank: int, device: torch.device, dtype: torch.dtype,
             rendezvous: Rendezvous) -> StageLink:
        """Join the replica's process group through this start's `rendezvous`, the backend's sockets
        on the plan's host (blocks until every stage has joined)."""
        backend = plan.backend
        interface = bind_interface(plan.host, backend)
        dist.init_process_group(backend, store=rendezvous.open(plan.world_size), rank=rank,
                                world_size=plan.world_size, timeout=datetime.timedelta(seconds=plan.timeout_s))
        # NCCL sends from the device bind made current (workers/device/bind.py); gloo through host memory
        on = device if backend == "nccl" else torch.device("cpu")
        mine = torch.tensor([layout.dtype_index(str(dtype).removeprefix("torch."))], dtype=torch.int64, device=on)
        every = [torch.empty_like(mine) for _ in range(plan.world_size)]
        dist.all_gather(every, mine)
        logger.info("pipeline stage %d of %d joined (%s on %s)", rank, plan.world_size, backend, interface)
        return cls(rank, plan.world_size, device, on, [getattr(torch, layout.dtype_name(int(t))) for t in every])

    def agree_blocks(self, blocks: list[int]) -> list[int]:
        """Each KV group's blocks: the fewest any stage can hold."""
        t = torch.tensor(blocks, dtype=torch.int64, device=self.wire)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return [int(x) for x in t.tolist()]

    def gather(self, obj) -> list | None:
        """Every stage's `obj` (plain JSON values) at the first stage (None elsewhere)."""
        data = layout.encode_json(obj)
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.wire)
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(self.wire)
        out = [torch.empty_like(mine) for _ in range(self.world)] if self.first else None
        dist.gather(mine, out, dst=0)
        if out is None:
            return None
        return [layout.decode_json(t[:int(n)].cpu().numpy().tobytes()) for t, n in zip(out, sizes, strict=True)]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- one step -------------------------------------------------------------------------
    def send_step(self, items, hidden: torch.Tensor) -> list:
        """To the next stage: the step's chunks and the hidden states [T, H]. Returns the sends
        under way (wait on them, `wait`, before the tensors may change): the caller computes on."""
        meta = torch.tensor(layout.encode_items(items), dtype=torch.int64, device=self.wire)
        header = torch.tensor(layout.header(STEP, meta.numel(), hidden.shape[0]), dtype=torch.int64, device=self.wire)
        return [dist.isend(t, self.rank + 1) for t in (header, meta, hidden.to(self.wire).contiguous())]

    def send_stop(self) -> None:
        dist.send(torch.tensor(layout.header(STOP, 0, 0), dtype=torch.int64, device=self.wire), self.rank + 1)

    @staticmethod
    def wait(sends: list) -> None:
        for work in sends:
            work.wait()

    def recv_step(self, hidden_size: int):
        """From the previous stage: (items, hidden [T, H] in this stage's dtype), or None to stop;
        `layout.WireError` for a message in any other layout (workers/pipeline/wire.py)."""
        header = torch.empty(layout.HEADER, dtype=torch.int64, device=self.wire)
        dist.recv(header, self.rank - 1)
        kind, n_meta, rows = layout.read_header(header.tolist())
        if kind == STOP:
            return None
        meta = torch.empty(n_meta, dtype=torch.int64, device=self.wire)
        dist.recv(meta, self.rank - 1)
        items = layout.decode_items(meta.tolist())  # before the hidden states: a bad message goes no further
        hidden = torch.empty(rows, hidden_size, dtype=self.dtypes[self.rank - 1], device=self.wire)
        dist.recv(hidden, self.rank - 1)
        return items, hidden.to(self.device, self.dtypes[self.rank])

    def send_logits(self, logits: torch.Tensor) -> list:
        """The last stage's logits [N, V], in its compute dtype (a head that computes in another
        dtype is a bug here: the first stage could not size the message)."""
        if logits.dtype != self.dtypes[self.rank]:
            raise TypeError(f"Logits in `{logits.dtype}`; this stage computes in {self.dtypes[self.rank]}, "
                            f"the dtype the first stage receives them in")
        return [dist.isend(logits.to(self.wire).contiguous(), 0)]

    def recv_logits(self, rows: int, vocab: int) -> torch.Tensor:
        """The last stage's logits [N, V] as fp32 (`Transformer.step`'s dtype) on this device."""
        out = torch.empty(rows, vocab, dtype=self.dtypes[self.world - 1], device=self.wire)
        dist.recv(out, self.world - 1)
        return out.to(self.device, torch.float32)
