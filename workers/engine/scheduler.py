"""Continuous-batching scheduler over a paged KV cache: which tokens run in the next step.

Design (vLLM v1 style): plain CPU bookkeeping behind a small interface, no tensors and no model,
so tests drive it with hand-built outputs. A sequence is its tokens and how many are in the
cache (`num_computed`). A step's token budget (`max_num_batched_tokens`) is filled in order:
every running decode (oldest first), the next chunk of running sequences still prefilling, then
newly admitted sequences (FCFS) from their cached prefix; a prompt longer than the budget left is
cut into chunks, so it never holds the others' decodes back for more than one step. A sequence
that needs a block when none is free preempts the newest running sequences (or itself): their
blocks are freed, full ones left cached, and they are recomputed later from the front of the
queue; with a host KV tier (workers/kvtier/) their blocks, the partly filled last one too, are
swapped out to it first and read back on resume instead of recomputed. Trade-off: recomputation
instead of refusal costs compute under memory pressure where no tier is, but the oldest sequence
always progresses and only a request that could never fit is refused."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass

from workers.contract import DEFAULT_KV_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS
from workers.engine.scheduler_output import ScheduledChunk, SchedulerOutput, TokenUpdate
from workers.engine.sequence import (
    FINISH_ABORT,
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISHED,
    RUNNING,
    WAITING,
    Sequence,
)
from workers.kv.hashing import root_hash
from workers.kv.manager import KVCacheManager
from workers.lora.apply import lora_key

WATERMARK = 0.01  # of the blocks, kept free when admitting, so running sequences can grow a while


def _cacheable(seq: Sequence) -> int | None:
    """How many leading tokens `seq` may take from the prefix cache (None: any). A prompt scored
    for its logprobs computes every row not scored yet: a row taken from the cache has no
    logits, so its entry would be missing."""
    if not seq.params.decoder_input_details:
        return None
    scored = 0 if seq.prompt_logprobs is None else len(seq.prompt_logprobs) - 1  # rows whose entries exist
    return None if scored >= len(seq.prompt_ids) - 1 else scored


class CapacityError(ValueError):
    """A request that can never fit this worker (answered with HTTP 422)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_sequences: int  # sequences running at once (--max-batch)
    max_seq_len: int  # longest sequence, prompt + generated (the model's context)
    num_blocks: int | None = None  # KV cache blocks in the pool (None: max_sequences full-length sequences)
    block_size: int = DEFAULT_KV_BLOCK_SIZE
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # tokens computed per step
    prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    cache_root: bytes = b""  # what besides tokens decides a block's contents (model, dtype, ...)
    # a rotary that depends on the sequence's length: (threshold, "dynamic" | "longrope"), else None
    rope: tuple[int, str] | None = None
    # (window, blocks) of each KV group (`KVPool.group_shapes`); None: one full group of `num_blocks`
    kv_groups: tuple[tuple[int | None, int], ...] | None = None
    # running sequences' slots of the linear layers' state pool; 0: no linear layers. Such a model
    # reuses a prefix only through snapshots of that state in `state_snapshots` spare slots
    # (workers/kv/snapshots.py); without them `prefix_caching` is turned off
    state_slots: int = 0
    state_snapshots: int = 0

    def __post_init__(self) -> None:
        if self.state_slots and self.prefix_caching and not self.state_snapshots:
            object.__setattr__(self, "prefix_caching", False)
        if self.num_blocks is None and self.block_size >= 1:
            object.__setattr__(self, "num_blocks", self.max_sequences * -(-self.max_seq_len // self.block_size))
        for name in ("max_sequences", "max_seq_len", "num_blocks", "block_size", "max_num_batched_tokens"):
            if (getattr(self, name) or 0) < 1:
                raise ValueError(f"`{name}` must be >= 1, got `{getattr(self, name)}`")
        if self.kv_groups is not None and self.kv_groups[0][1] != self.num_blocks:
            raise ValueError(f"`kv_groups` `{self.kv_groups}` must start with the `num_blocks` "
                             f"`{self.num_blocks}` group")

    @property
    def max_tokens(self) -> int:
        """Tokens the whole KV pool holds."""
        return self.num_blocks * self.block_size

    @property
    def slides_only(self) -> bool:
        """Every KV group slides: a sequence holds about a window of blocks, however long it is."""
        return bool(self.kv_groups) and all(w is not None for w, _ in self.kv_groups)


class Scheduler:
    """The engine's scheduler (plain CPU code): `add_request`, `abort_request`, `schedule`,
    `update_from_output`, `finish`, `has_unfinished`."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._init_queues()
        self._init_kv()

    def _init_queues(self) -> None:
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: oldest first
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_swapped_out = 0  # preemptions whose blocks went to the host tier (workers/kvtier/)
        self.num_recomputed_tokens = 0  # tokens preempted sequences had computed and computed again
        self.lora_slot: Callable[[Sequence], bool] = lambda seq: False  # the engine's, once it serves adapters

    def _init_kv(self) -> None:
        c = self.config
        self.kv = KVCacheManager(c.num_blocks, c.block_size, c.prefix_caching, c.cache_root, c.kv_groups,
                                 c.state_slots, c.state_snapshots if c.prefix_caching else 0)
        self._reserve = int(WATERMARK * c.num_blocks)

    # -- admission ---------------------------------------------------------------------------

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """`CapacityError` naming the numbers when a request can never fit this worker."""
        if prompt_len < 1:
            raise CapacityError("`inputs` must contain at least one token")
        c = self.config
        total = prompt_len + max_new_tokens
        given = f"Given: {prompt_len} `inputs` tokens and {max_new_tokens} `max_new_tokens` ({total} tokens)"
        if total > c.max_seq_len:
            raise CapacityError(f"`inputs` tokens + `max_new_tokens` must be <= {c.max_seq_len} on this worker. "
                                f"{given}")
        if total > c.max_tokens and not c.slides_only:
            raise CapacityError(
                f"`inputs` tokens + `max_new_tokens` must be <= {c.max_tokens}, the whole KV cache of this "
                f"worker ({c.num_blocks} blocks of {c.block_size} tokens). {given}"
            )

    def add_request(self, seq: Sequence) -> None:
        self.check_fits(len(seq.prompt_ids), seq.params.context_tokens)
        if self.config.rope is not None:
            self._rope_phase(seq)
        if seq.request_id in self._by_id:
            raise ValueError(f"Request id `{seq.request_id}` is already in the scheduler")
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def _rope_phase(self, seq: Sequence) -> None:
        """A sequence whose length changes its rotation (workers/model/rope.py): a prompt past a
        dynamic rotary's threshold is rotated for its own length, and a sequence past LongRoPE's
        (a long prompt, or a stream resumed past it) takes the long factors from its first token;
        either way its blocks are shared only with sequences rotated alike."""
        threshold, kind = self.config.rope
        if kind == "longrope" and seq.num_tokens > threshold:
            seq.rope_len = max(seq.rope_len, seq.num_tokens)
        if seq.rope_len > threshold:
            key = f"rope:{seq.rope_len}" if kind == "dynamic" else "rope:long"
            seq.cache_root = root_hash(self.config.cache_root, key, *lora_key(seq.lora))

    def _switch_to_long(self, seq: Sequence, preempted: list[Sequence]) -> None:
        """LongRoPE: the sequence grows past the threshold, so it is computed again from its first
        token with the long factors (as transformers' Phi-3 drops its cache then): its blocks are
        freed, its block hashes (under the short root) forgotten, and it goes back to the front of
        the queue with its tokens, like a preemption that memory did not force."""
        self.kv.free(seq)
        self.running.remove(seq)
        seq.num_computed, seq.status = 0, WAITING
        seq.block_hashes = []
        seq.rope_len = seq.num_tokens
        self._rope_phase(seq)
        self.waiting.appendleft(seq)
        preempted.append(seq)

    def abort_request(self, request_id: str) -> Sequence | None:
        """Drop a waiting or running request (client gone); frees its blocks now."""
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

    def schedule(self, busy: frozenset[int] = frozenset(), limit: int | None = None) -> SchedulerOutput:
        """The next step's chunks. `busy`: id() of sequences in a step still in flight (a pipeline's
        earlier batch, workers/pipeline/engine.py): neither scheduled nor preempted now; `limit`: at
        most this many chunks (one batch of several in flight)."""
        budget = self.config.max_num_batched_tokens
        limit = limit or self.config.max_sequences
        chunks: list[ScheduledChunk] = []
        scheduled: set[int] = set(busy)  # id() of the sequences in `chunks` (and in flight: never victims)
        preempted: list[Sequence] = []
        # 1. Decodes of running sequences, oldest first; a block shortage preempts newer ones.
        prompting = []
        switch = self.config.rope[0] if self.config.rope and self.config.rope[1] == "longrope" else None
        for seq in list(self.running):
            if seq.status != RUNNING or id(seq) in busy:
                continue
            if len(chunks) >= limit:
                break
            if switch is not None and seq.num_tokens > switch >= seq.rope_len:
                self._switch_to_long(seq, preempted)
                continue
            if seq.num_tokens - seq.num_computed != 1:
                prompting.append(seq)
            elif seq.draft_ids and self._fits_drafts(seq, budget):  # its drafts verified with it
                chunks.append(ScheduledChunk(seq, seq.num_computed, [seq.output_ids[-1], *seq.draft_ids],
                                             seq.block_ids, True, False))
                scheduled.add(id(seq))
                budget -= 1 + len(seq.draft_ids)
            elif self._grow_or_preempt(seq, 1, scheduled, preempted):  # else it preempted itself
                chunks.append(self._chunk(seq, 1))
                scheduled.add(id(seq))
                budget -= 1
        # 2. The next chunk of running sequences whose prompt is not done, oldest first.
        for seq in prompting:
            if budget <= 0 or len(chunks) >= limit:
                break
            if seq.status != RUNNING:  # preempted by an older one in this step
                continue
            n = self._fit(seq, self.kv.chunk(seq, min(seq.num_tokens - seq.num_computed, budget)), scheduled,
                          preempted)
            if n:
                chunks.append(self._chunk(seq, n))
                scheduled.add(id(seq))
                budget -= n
        # 3. Admit waiting sequences (FCFS) from their cached prefix while batch, budget and blocks allow.
        #    A sequence waiting for a LoRA slot that none frees yet keeps its place (workers/lora/waiting.py).
        cached = queried = 0
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_sequences and len(chunks) < limit:
            seq = self.waiting[0]
            if seq.lora_wait is not None and not self.lora_slot(seq):
                skipped.append(self.waiting.popleft())
                continue
            admission = self.kv.admit(seq, budget, self._reserve if self.running else 0, _cacheable(seq))
            if admission is None:
                break
            self.waiting.popleft()
            seq.status = RUNNING
            self.running.append(seq)
            cached += admission.cached_tokens
            queried += admission.queried_tokens
            if seq.computed_at_preemption:  # a resume: what neither the device nor the host tier held
                self.num_recomputed_tokens += max(0, seq.computed_at_preemption - admission.cached_tokens)
                seq.computed_at_preemption = 0
            n = self.kv.chunk(seq, min(seq.num_tokens - seq.num_computed, budget))
            chunks.append(self._chunk(seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        prefill = sum(len(c.token_ids) for c in chunks if c.is_prefill)
        return SchedulerOutput(tuple(chunks), prefill, cached, queried, tuple(preempted))

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start, prompt = seq.num_computed, len(seq.prompt_ids)
        end = start + n
        if n == 1 and start >= prompt:  # the decode token: the last generated one
            tokens = [seq.output_ids[start - prompt]]
        else:
            tokens = seq.token_ids()[start:end]
        return ScheduledChunk(seq, start, tokens, seq.block_ids, end == seq.num_tokens,
                              n > 1 or start < prompt)

    def _fits_drafts(self, seq: Sequence, budget: int) -> bool:
        """Blocks and budget for a decode row and its draft tokens, never preempting for drafts:
        when they do not fit now, the drafts are dropped and the row decodes one token."""
        n = 1 + len(seq.draft_ids)
        if n <= budget and self.kv.grow(seq, seq.num_computed + n):
            return True
        seq.draft_ids = []
        return False

    def _grow_or_preempt(self, seq: Sequence, n: int, scheduled: set[int], preempted: list[Sequence]) -> bool:
        """Blocks for `seq`'s next `n` tokens, preempting newer unscheduled sequences (newest
        first) while the pool is short; preempts `seq` itself when nothing newer is left."""
        while not self.kv.grow(seq, seq.num_computed + n):
            victim = self._newest_unscheduled_after(seq, scheduled)
            self._preempt(victim or seq, preempted)
            if victim is None:
                return False
        return True

    def _fit(self, seq: Sequence, n: int, scheduled: set[int], preempted: list[Sequence]) -> int:
        """How many of `n` prompt tokens `seq` can compute now (blocks taken): all of them if
        preempting newer unscheduled sequences makes room, else as many as the free blocks hold."""
        while not self.kv.grow(seq, seq.num_computed + n):
            victim = self._newest_unscheduled_after(seq, scheduled)
            if victim is None:
                room = self.kv.room(seq) - seq.num_computed
                n = max(0, min(n, room))
                return n if n and self.kv.grow(seq, seq.num_computed + n) else 0
            self._preempt(victim, preempted)
        return n

    def _newest_unscheduled_after(self, seq: Sequence, scheduled: set[int]) -> Sequence | None:
        for other in reversed(self.running):
            if other is seq:
                return None
            if id(other) not in scheduled:
                return other
        return None

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        """Free a running sequence's blocks (swapped to the host tier first, where there is one) and
        requeue it first; it keeps its tokens."""
        self.num_swapped_out += self.kv.swap_out(seq)
        seq.computed_at_preemption = seq.num_computed
        self.kv.free(seq)
        self.running.remove(seq)
        seq.num_computed, seq.status = 0, WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        preempted.append(seq)

    def update_from_output(
        self, output: SchedulerOutput, token_ids: SequenceT[int], logprobs: SequenceT[float]
    ) -> list[TokenUpdate]:
        """Advance every chunk's sequence; append the sampled token to each sampling chunk (in
        chunk order) and finish on EOS (unless `ignore_eos`), a stop token id (both only from
        `min_tokens` on) or length; index the blocks that became full."""
        bs, sliding = self.config.block_size, self.kv.sliding
        updates = []
        sampled = iter(zip(token_ids, logprobs, strict=True))
        for chunk in output.chunks:
            seq = chunk.seq
            tid, lp = next(sampled) if chunk.samples else (None, None)
            if seq.status != RUNNING:  # finished while the step ran (cannot happen in one thread)
                continue
            seq.num_computed += len(chunk.token_ids)
            if seq.num_computed // bs > seq.num_cached_blocks:  # a block became full: index it
                self.kv.cache_full_blocks(seq)
            if sliding:  # a sliding group frees what its window left behind
                self.kv.slide(seq)
            if tid is not None:
                updates.append(self.append_token(seq, tid, lp))
        return updates

    def append_token(self, seq: Sequence, tid: int, lp: float) -> TokenUpdate:
        """Append one generated token to a running sequence and finish it on EOS (unless
        `ignore_eos`), a stop token id (both only from `min_tokens` on) or length."""
        seq.output_ids.append(tid)
        seq.logprobs.append(lp)
        reason, p = None, seq.params
        ended = len(seq.output_ids) >= p.min_tokens  # before `min_tokens`, neither EOS nor a stop id ends it
        if tid in self.config.eos_token_ids and ended and not p.ignore_eos:
            reason = FINISH_EOS
        elif tid in p.stop_token_ids and ended:
            reason = FINISH_STOP
        elif len(seq.output_ids) >= p.max_new_tokens or seq.publish_kv:  # a prefill for another worker: one token
            reason = FINISH_LENGTH
        if reason is not None:
            self.finish(seq, reason)
        return TokenUpdate(seq, tid, lp, reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence and free its blocks (idempotent)."""
        if seq.status == FINISHED:
            return
        if seq.status == RUNNING:
            self.running.remove(seq)
            self.kv.free(seq)
        elif seq in self.waiting:  # preempted, then stopped by the engine
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = FINISHED, reason
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

    def capacity(self) -> dict:
        """`/capability` `capacity`: batch, lengths and the KV pool in blocks and tokens
        (`max_seq_len`: the longest request served, the context or the whole pool)."""
        c = self.config
        return {
            "max_sequences": c.max_sequences, "max_tokens": c.max_tokens,
            "max_seq_len": c.max_seq_len if c.slides_only else min(c.max_seq_len, c.max_tokens),
            "kv_block_size": c.block_size, "kv_blocks_total": c.num_blocks,
            "kv_blocks_free": self.kv.num_free_blocks, "prefix_cache": c.prefix_caching,
            "max_num_batched_tokens": c.max_num_batched_tokens,
            **({"state_slots": c.state_slots, "state_slots_free": self.kv.states.num_free} if c.state_slots else {}),
            **({"state_snapshots": self.kv.snapshots.describe()} if self.kv.snapshots is not None else
               {"prefix_cache_off": "no slots for snapshots of the linear layers' state (workers/kv/snapshots.py)"}
               if c.state_slots else {}),
        }
