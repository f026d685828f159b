"""One request's state inside the engine: its tokens, where they stand in the cache, its status.

A `Sequence` is what the scheduler schedules, the runner computes and the output processor
finishes; it lives on the engine thread only and is never shared with the HTTP side, which
sees frozen events instead (workers/engine/events.py). Its status moves `waiting` ->
`running` -> `finished`, and back to `waiting` when it is preempted (its tokens kept, its
cache freed); a finished sequence carries why (`FINISH_*`, TGI's names). The policy that
moves it lives apart, in workers/engine/scheduler.py, as vLLM keeps `Request` apart from its
scheduler. Trade-off: mutable slots rather than a frozen value, since a sequence changes at
every step and copying it per token would cost more than the step's bookkeeping.
"""

from __future__ import annotations

import itertools
import time

from workers.contract.events import FINISH_ABORT, FINISH_EOS, FINISH_LENGTH, FINISH_STOP  # noqa: F401 (TGI's names)
from workers.sampling.params import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
_UIDS = itertools.count()


class Sequence:
    """One request's mutable state inside the engine (not shared with the HTTP side)."""

    __slots__ = (
        "uid", "request_id", "prompt_ids", "params", "output_ids", "logprobs", "num_computed", "status",
        "finish_reason", "generator", "seed", "arrival_time", "first_token_time", "detok", "stream",
        "block_ids", "group_tables", "held_from", "block_hashes", "num_cached_blocks", "num_preemptions", "grammar",
        "prompt_logprobs", "computed_at_preemption",
        "cache_root", "rope_len", "state_slot", "lora", "draft_ids", "spec_drafted", "spec_accepted",
        "publish_kv", "lora_wait", "snapshot_key",
    )

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, generator=None):
        self.uid = next(_UIDS)  # unique in this process, never reused (request ids may be)
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.num_computed = 0  # leading tokens whose K/V are in the cache
        self.status = WAITING
        self.finish_reason: str | None = None
        self.generator = generator  # per-request torch.Generator when sampling
        self.seed: int | None = None  # the seed actually used (reported in details)
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.detok = None  # the engine's IncrementalDetokenizer
        self.stream = None  # the engine's delivery target
        self.block_ids: list[int] = []  # KV blocks holding positions 0.. in order (the block table)
        self.group_tables: list[list[int]] = []  # the other KV groups' tables (sliding layers: kv/groups.py)
        self.held_from: list[int] = []  # per KV group, its first held block (a sliding group frees its past)
        self.block_hashes: list[bytes] = []  # chained hashes of its full blocks, computed once
        self.num_cached_blocks = 0
        self.num_preemptions = 0
        self.computed_at_preemption = 0  # tokens it had in the cache when last preempted (until resumed)
        self.grammar = None  # this request's grammar matcher (structured output), advanced per token
        self.prompt_logprobs: list | None = None  # (token id, logprob, top) per prompt token, when asked
        self.cache_root: bytes | None = None  # its blocks' hash root when it differs from the model's
        self.rope_len = len(self.prompt_ids)  # the length its rotary is computed for (workers/model/rope.py)
        self.lora = None  # its LoRA adapter (workers/lora/adapter.py); None: the base model
        self.lora_wait: str | None = None  # the adapter it waits for a slot of (workers/lora/waiting.py)
        self.state_slot = -1  # its slot of the linear layers' state while it holds KV blocks (workers/kv/state.py)
        self.snapshot_key: bytes | None = None  # its latest state snapshot's key (workers/kv/snapshots.py)
        self.draft_ids: list[int] = []  # draft tokens its next decode verifies (workers/engine/speculate.py)
        self.spec_drafted = self.spec_accepted = 0  # its draft tokens verified and accepted so far
        self.publish_kv = False  # its prompt's KV is in the host tier before its last event (a prefill handed off)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status}, computed={self.num_computed}/{self.num_tokens}, "
                f"blocks={len(self.block_ids)})")
