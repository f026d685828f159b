"""The pipeline's wire: one `torch.distributed` process group per replica, stage to stage.

Design: stage `r` sends stage `r + 1` each step a header (`[kind, meta bytes, rows]` int64), the
step's chunks (pickled `(SeqChunk, token ids)` pairs, so every stage builds the same batch) and
the hidden states `[T, H]` in the compute dtype; the last stage sends the logits back in its
compute dtype, which the first makes fp32 (the cast a single worker makes, at half the bytes).
Sends do not wait for the receiver (`isend`); no fp8 and no sampling state crosses. The backend is
the plan's (server/fleet/pipelines.py `backend_for`): NCCL (RCCL) when every stage is a real GPU of
one vendor, gloo through host memory otherwise. Trade-off: a step's chunks are pickled on every
hop rather than kept as state on each stage, so a stage holds no scheduler state and a restarted
pipeline has nothing to reconcile."""

from __future__ import annotations

import datetime
import logging
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.contract.pipeline import PipelinePlan

logger = logging.getLogger(__name__)

STEP, STOP = 0, 1


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
    def join(cls, plan: PipelinePlan, rank: int, device: torch.device, dtype: torch.dtype) -> StageLink:
        """Join the replica's process group (blocks until every stage has joined)."""
        backend = plan.backend
        dist.init_process_group(backend, init_method=f"tcp://{plan.address}", rank=rank, world_size=plan.world_size,
                                timeout=datetime.timedelta(seconds=plan.timeout_s))
        # NCCL sends from the device bind made current (workers/device/bind.py); gloo through host memory
        wire = device if backend == "nccl" else torch.device("cpu")
        names: list = [None] * plan.world_size
        dist.all_gather_object(names, str(dtype).removeprefix("torch."))
        logger.info("pipeline stage %d of %d joined (%s)", rank, plan.world_size, backend)
        return cls(rank, plan.world_size, device, wire, [getattr(torch, n) for n in names])

    def agree_blocks(self, blocks: list[int]) -> list[int]:
        """Each KV group's blocks: the fewest any stage can hold."""
        t = torch.tensor(blocks, dtype=torch.int64, device=self.wire)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return [int(x) for x in t.tolist()]

    def gather(self, obj) -> list | None:
        """Every stage's `obj` at the first stage (None elsewhere)."""
        out = [None] * self.world if self.first else None
        dist.gather_object(obj, out, dst=0)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- one step -------------------------------------------------------------------------
    def send_step(self, items, hidden: torch.Tensor) -> list:
        """To the next stage: the step's chunks and the hidden states [T, H]. Returns the sends
        under way (wait on them, `wait`, before the tensors may change): the caller computes on."""
        meta = torch.frombuffer(bytearray(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        header = torch.tensor([STEP, meta.numel(), hidden.shape[0]], dtype=torch.int64, device=self.wire)
        return [dist.isend(t, self.rank + 1) for t in (header, meta.to(self.wire), hidden.to(self.wire).contiguous())]

    def send_stop(self) -> None:
        dist.send(torch.tensor([STOP, 0, 0], dtype=torch.int64, device=self.wire), self.rank + 1)

    @staticmethod
    def wait(sends: list) -> None:
        for work in sends:
            work.wait()

    def recv_step(self, hidden_size: int):
        """From the previous stage: (items, hidden [T, H] in this stage's dtype), or None to stop."""
        header = torch.empty(3, dtype=torch.int64, device=self.wire)
        dist.recv(header, self.rank - 1)
        kind, n_meta, rows = (int(x) for x in header.tolist())
        if kind == STOP:
            return None
        meta = torch.empty(n_meta, dtype=torch.uint8, device=self.wire)
        dist.recv(meta, self.rank - 1)
        hidden = torch.empty(rows, hidden_size, dtype=self.dtypes[self.rank - 1], device=self.wire)
        dist.recv(hidden, self.rank - 1)
        items = pickle.loads(meta.cpu().numpy().tobytes())  # noqa: S301 (our own stages, in one process group)
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
