"""Continuous-batching scheduler: which sequences run in the next step.

Design (vLLM v1 `SchedulerInterface` style): plain CPU bookkeeping behind a small
interface, no tensors and no model, so tests drive it with hand-built outputs.
- A waiting queue (FCFS) and a running set. Each running sequence owns one KV cache slot
  (the cache reserves `max_seq_len` positions per slot), so capacity accounting is slots in
  use and the tokens they reserve.
- `schedule()` returns one chunk per running sequence (one decode token, ordered by slot so
  the model reads consecutive slots as views) followed by whole-prompt prefills of newly
  admitted sequences, admitted while a slot is free and the step's prefill token budget
  holds (the first prompt of a step is always admitted, so a long prompt cannot starve).
- `update_from_output()` appends each sampled token and finishes sequences on EOS or
  `max_new_tokens`; the engine finishes on stop strings through `finish()`. A finished or
  aborted sequence frees its slot at once, so a newcomer can take it in the next step.
Trade-off: no chunked prefill and no preemption. Admission already guarantees that
`prompt + max_new_tokens` fits a slot, so a running sequence never runs out of cache.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

from workers.sampling import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
FINISH_LENGTH, FINISH_EOS, FINISH_STOP, FINISH_ABORT = "length", "eos_token", "stop_sequence", "aborted"


class CapacityError(ValueError):
    """A request that can never fit this worker (answered with HTTP 422)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_sequences: int  # KV cache slots = most sequences running at once
    max_seq_len: int  # tokens one slot holds (prompt + generated)
    max_prefill_tokens: int = 4096  # prompt tokens admitted per step (at least one prompt)
    eos_token_ids: tuple[int, ...] = ()

    @property
    def max_tokens(self) -> int:
        return self.max_sequences * self.max_seq_len


class Sequence:
    """One request's mutable state inside the engine (not shared with the HTTP side)."""

    __slots__ = (
        "request_id", "prompt_ids", "params", "output_ids", "logprobs", "slot", "num_computed",
        "status", "finish_reason", "generator", "seed", "arrival_time", "first_token_time", "detok", "stream",
        "grammar", "prompt_logprobs",
    )

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, generator=None):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.slot: int | None = None
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.status = WAITING
        self.finish_reason: str | None = None
        self.generator = generator  # per-request torch.Generator when sampling
        self.seed: int | None = None  # the seed actually used (reported in details)
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.detok = None  # the engine's IncrementalDetokenizer
        self.stream = None  # the engine's delivery target
        self.grammar = None  # this request's grammar matcher (structured output), advanced per token
        self.prompt_logprobs: list | None = None  # (token id, logprob, top) per prompt token, when asked

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def reserved_tokens(self) -> int:
        """Cache positions this sequence may use by its end."""
        return len(self.prompt_ids) + self.params.max_new_tokens

    def __repr__(self) -> str:
        return f"Sequence({self.request_id!r}, {self.status}, slot={self.slot}, out={len(self.output_ids)})"


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One sequence's tokens in a step: its whole prompt (prefill) or its last token (decode)."""

    seq: Sequence
    slot: int
    start_pos: int
    token_ids: list[int]

    @property
    def is_prefill(self) -> bool:
        return self.start_pos == 0


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # decodes (by slot), then prefills
    num_prefill_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """What one step did to one sequence: the token it got and whether it finished."""

    seq: Sequence
    token_id: int
    logprob: float
    finish_reason: str | None


class Scheduler:
    """The engine's scheduler (plain CPU code): `add_request`, `abort_request`, `schedule`,
    `update_from_output`, `finish`, `has_unfinished`."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._init_queues()
        self._init_slots()

    def _init_queues(self) -> None:
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self._by_id: dict[str, Sequence] = {}

    def _init_slots(self) -> None:
        self._free_slots = list(range(self.config.max_sequences))  # a heap: lowest slot first
        self.reserved_tokens = 0

    # -- admission ---------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """`CapacityError` naming the numbers when a request can never fit one slot."""
        if prompt_len < 1:
            raise CapacityError("`inputs` must contain at least one token")
        total, limit = prompt_len + max_new_tokens, self.config.max_seq_len
        if total > limit:
            raise CapacityError(
                f"`inputs` tokens + `max_new_tokens` must be <= {limit} on this worker. "
                f"Given: {prompt_len} `inputs` tokens and {max_new_tokens} `max_new_tokens` ({total} tokens)"
            )

    def add_request(self, seq: Sequence) -> None:
        self.check_fits(len(seq.prompt_ids), seq.params.max_new_tokens)
        if seq.request_id in self._by_id:
            raise ValueError(f"Request id `{seq.request_id}` is already in the scheduler")
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def abort_request(self, request_id: str) -> Sequence | None:
        """Drop a waiting or running request (client gone); frees its slot now."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        if seq.status == WAITING:
            self.waiting.remove(seq)
            seq.status, seq.finish_reason = FINISHED, FINISH_ABORT
            del self._by_id[request_id]
        else:
            self.finish(seq, FINISH_ABORT)
        return seq

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        # 1. Every running sequence decodes its last token, in slot order.
        chunks = [
            ScheduledChunk(seq, slot, seq.num_computed, [seq.output_ids[-1]])
            for slot, seq in sorted(self.running.items())
        ]
        # 2. Admit waiting prompts FCFS while a slot is free and the prefill budget holds.
        budget = self.config.max_prefill_tokens
        prefill_tokens = 0
        while self.waiting and self._free_slots:
            seq = self.waiting[0]
            # A resumed sequence arrives with output tokens generated elsewhere: prefill them too.
            tokens = seq.prompt_ids + seq.output_ids if seq.output_ids else seq.prompt_ids
            n = len(tokens)
            if prefill_tokens and prefill_tokens + n > budget:
                break
            self.waiting.popleft()
            slot = heapq.heappop(self._free_slots)
            seq.slot, seq.status = slot, RUNNING
            self.running[slot] = seq
            self.reserved_tokens += seq.reserved_tokens
            prefill_tokens += n
            chunks.append(ScheduledChunk(seq, slot, 0, tokens))
        return SchedulerOutput(tuple(chunks), prefill_tokens)

    def update_from_output(
        self, output: SchedulerOutput, token_ids: SequenceT[int], logprobs: SequenceT[float]
    ) -> list[TokenUpdate]:
        """Append each chunk's sampled token; finish on EOS or length."""
        eos = self.config.eos_token_ids
        updates = []
        for chunk, tid, lp in zip(output.chunks, token_ids, logprobs, strict=True):
            seq = chunk.seq
            if seq.status != RUNNING:  # finished while the step ran (cannot happen in one thread)
                continue
            seq.num_computed += len(chunk.token_ids)
            seq.output_ids.append(tid)
            seq.logprobs.append(lp)
            reason = None
            if tid in eos:
                reason = FINISH_EOS
            elif len(seq.output_ids) >= seq.params.max_new_tokens:
                reason = FINISH_LENGTH
            if reason is not None:
                self.finish(seq, reason)
            updates.append(TokenUpdate(seq, tid, lp, reason))
        return updates

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence and free its slot (idempotent)."""
        if seq.status == FINISHED:
            return
        seq.status, seq.finish_reason = FINISHED, reason
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            heapq.heappush(self._free_slots, seq.slot)
            self.reserved_tokens -= seq.reserved_tokens
        self._by_id.pop(seq.request_id, None)

    # -- accounting --------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def capacity(self) -> dict:
        c = self.config
        return {"max_sequences": c.max_sequences, "max_tokens": c.max_tokens, "max_seq_len": c.max_seq_len}
