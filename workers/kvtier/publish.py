"""A sequence's blocks published to the host tier now, and known to be there when this returns.

Written through as they fill, a sequence's full blocks reach the tier a step or so after they
fill, and its partly filled last block only when the sequence stops holding it. A sequence about
to continue elsewhere (its stream moves to another worker, another worker is to decode what this
one prefilled) must have every token computed here in the tier before the other worker looks its
prefix up, else that worker recomputes whatever the writer had not written yet. Design:
`publish` queues every computed block of each sequence through the block manager (full blocks
the tier already holds are skipped by the tier, the partial one goes with the tokens it holds)
and then waits until the writer has written everything queued: its return is the
acknowledgement, after which any worker of the same KV format reads them. The sequences keep
their device blocks; freeing them (an abort) afterwards writes nothing new. Trade-off: the wait is
on the engine thread and covers every block queued, not only these sequences' (at most the
writer's queue); it is paid only when sequences move, and saves their prefill on the next worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    """What `publish` put in the tier: tokens per sequence, in order; blocks the writer dropped
    (a full queue: recomputed by whoever needs them); or why nothing was published."""

    tokens: tuple[int, ...]
    dropped: int = 0
    reason: str | None = None

    @property
    def total(self) -> int:
        return sum(self.tokens)


def publish(kv, seqs) -> Published:
    """Every computed block of `seqs` (the block manager `kv`'s sequences) in the host tier, the
    partly filled last blocks too, written when this returns; nothing without a tier."""
    tier = getattr(kv, "tier", None)
    if tier is None:
        return Published(tuple(0 for _ in seqs), reason="no host KV tier on this worker")
    before = tier.writer.dropped if tier.writer is not None else 0
    tokens = tuple(kv.publish(seq) for seq in seqs)
    tier.flush()
    dropped = (tier.writer.dropped if tier.writer is not None else 0) - before
    return Published(tokens, dropped)
