"""The engine: a loop in its own thread that turns requests into tokens on one device.

Design: each step is schedule -> execute -> update: the `Scheduler` (plain CPU code) picks the
step's decodes and prompt chunks, the `ModelRunner` runs them as ONE `model.step` and
`sample_tokens()` picks a token per row (grammar masks computed on a helper thread meanwhile),
then the scheduler advances the sequences and the `OutputProcessor` makes each request's events,
delivered in one batch per event loop. Requests join and leave only between steps, so an aborted
request's blocks are free for the very next step; a preempted sequence sends nothing until it
samples again, so a client never sees a token twice. Beyond `max_sequences + max_queue` requests
in flight `submit()` raises `EngineOverloaded` (a 429) instead of queueing forever.
An idle engine runs a short prompt's first step (at most `INLINE_MAX_TOKENS`) on the submitting
thread, sparing a quiet worker's request two thread hand-offs. Trade-off: that step blocks the
caller's event loop, so a longer prompt goes to the engine thread, where the requests of a burst
arriving behind it are read meanwhile and share its steps; the Python bookkeeping of each step
shares the GIL with the HTTP side, so it is kept to a few list operations per sequence."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceT
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from workers.contract import DEFAULT_MAX_QUEUE
from workers.contract.detokenize import special_token_ids
from workers.engine.admission import EngineOverloaded, EngineUnavailable, new_sequence
from workers.engine.ending import end_every_request
from workers.engine.events import RequestStream, deliver
from workers.engine.liveness import Liveness, LivenessClock
from workers.engine.metrics import WorkerMetrics
from workers.engine.openmp import pool_released
from workers.engine.output import OutputProcessor
from workers.engine.resume import check_resume_ids
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.engine.speculate import Speculator
from workers.lora.metrics import LoraLoad, lora_load
from workers.lora.waiting import acquire_or_wait, attach, take_slot
from workers.sampling.grammar import CompiledGrammar, Grammars
from workers.sampling.logprobs import prompt_chunks, record_prompt
from workers.sampling.params import SamplingParams
from workers.sampling.sampler import grammar_bitmask, sample_tokens

logger = logging.getLogger(__name__)


_ADD, _ABORT, _WAKE, _STOP = "add", "abort", "wake", "stop"
INLINE_MAX_TOKENS = 32  # an idle engine's first step runs on the submitting thread up to this many tokens


class Engine:
    def __init__(
        self,
        runner,
        scheduler: Scheduler,
        tokenizer,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        metrics: WorkerMetrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        grammars: Grammars | None = None,
        speculator: Speculator | None = None,
    ):
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.speculator = speculator  # draft tokens verified in the step (workers/engine/speculate.py)
        self.grammars = grammars  # the grammar engine constrained requests use
        self.metrics = metrics or WorkerMetrics()
        self.on_fatal = on_fatal
        self.output = OutputProcessor(scheduler, self.metrics)
        scheduler.kv.attach_states(getattr(runner, "kv", None))  # a hybrid's snapshots copy within its state pool
        self._init_admission(max_queue)
        self._init_thread()
        self.metrics.track(self.load, self.kv_usage)  # the gateway gauges, read at scrape time

    def _init_admission(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.max_in_flight = self.scheduler.config.max_sequences + max_queue
        self._special_ids = special_token_ids(self.tokenizer)
        self._lock = threading.Lock()
        self._in_flight = 0
        self._side_running = 0  # side work (embeddings) in flight, counted in `_in_flight` too
        self._accepting = True
        self._next_id = 0
        self.loras = None  # the worker's LoRA adapters (workers/lora/table.py), when it serves any
        self.lora_load = LoraLoad()  # their running and waiting requests after the last step
        self.scheduler.lora_slot = lambda seq: take_slot(self, seq)  # a waiting adapter's slot (workers/lora/)
        self._liveness = LivenessClock()

    def _init_thread(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._step_lock = threading.RLock()  # the scheduler and the model: one step at a time
        self._masker: ThreadPoolExecutor | None = None  # grammar masks, overlapped with the forward
        self._num_threads = torch.get_num_threads()
        self._stopping = False
        self.fatal_error: BaseException | None = None
        self.host_tier = None  # the host KV tier (workers/kvtier/), set by `attach_tier`

    # -- called from the HTTP side (any thread) --------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop | None = None,
        request_id: str | None = None,
        grammar: CompiledGrammar | None = None,
        resume_ids: SequenceT[int] = (),
        text: bool = True,
        lora: str | None = None,
        publish_kv: bool = False,
    ) -> RequestStream:
        """Queue a request (`grammar`: its compiled `params.grammar`; `resume_ids`: tokens already
        generated for it elsewhere; `text` False: no text and no stop strings here, the router's
        channel builds them from the token ids; `lora`: the adapter it runs with, None the base;
        `publish_kv`: its prompt's KV blocks are written to the host tier before its last event);
        raises `CapacityError` (never fits), `ParameterError` (bad `resume_ids`), `UnknownLora`,
        `EngineOverloaded` (queue full) or `EngineUnavailable` (draining / dead)."""
        if (grammar is None) != (params.grammar is None):
            raise ValueError("`grammar` must be the compiled `params.grammar` (both given or neither)")
        self.scheduler.check_fits(len(prompt_ids), params.context_tokens)
        resumed = check_resume_ids(resume_ids, params, getattr(self.runner, "vocab_size", None))
        with self._lock:
            self._admit_locked()
            self._next_id += 1
            rid = request_id or f"req-{self._next_id}"
            try:
                adapter = None if lora is None else acquire_or_wait(self.loras, lora)
            except BaseException:
                self._in_flight -= 1
                raise
        seq = new_sequence(rid, prompt_ids, params, loop, grammar, resumed, text, self.tokenizer, self._special_ids)
        seq.publish_kv = publish_kv
        if lora is not None:  # its adapter, or the wait for a slot (workers/lora/waiting.py)
            attach(seq, lora, adapter, self.scheduler.config.cache_root)
        if not self._first_step_here(seq):
            self._inbox.put((_ADD, seq))
        return seq.stream

    def _admit_locked(self) -> None:
        """Count one more request in flight, or raise `EngineUnavailable` / `EngineOverloaded` (under `_lock`)."""
        if not self._accepting or self.fatal_error is not None:
            raise EngineUnavailable("The worker is not accepting requests (draining or stopped)")
        if self._in_flight >= self.max_in_flight:
            self.metrics.rejected.labels("overloaded").inc()
            raise EngineOverloaded(
                f"Worker queue is full: {self._in_flight} requests in flight, limit "
                f"{self.max_in_flight} ({self.scheduler.config.max_sequences} running + {self.max_queue} queued)"
            )
        if self._in_flight == 0:
            self._liveness.work_arrived()
        self._in_flight += 1

    @contextlib.contextmanager
    def side_work(self):
        """Work beside the scheduler (a request's embeddings) admitted and counted as one request:
        refused like one when the worker is full or draining, shown running in `load` meanwhile,
        and waited for by a drain. Its forwards stamp the liveness clock (`progress`)."""
        with self._lock:
            self._admit_locked()
            self._side_running += 1
        self._publish_load()
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._side_running -= 1
            self._publish_load()

    def progress(self) -> None:
        """Side work finished a forward: the engine is not stalled."""
        self._liveness.progress()

    def _first_step_here(self, seq: Sequence) -> bool:
        """When the engine thread is idle and `seq` is short, add it and run its first step on this
        thread (no hand-off); the engine thread is woken only if more steps are needed. False
        (nothing done) when the engine is busy, not started, another thread holds the step lock,
        or `seq` has more than `INLINE_MAX_TOKENS` tokens to compute (the module docstring says why)."""
        if seq.num_tokens > INLINE_MAX_TOKENS or self._thread is None or not self._step_lock.acquire(blocking=False):
            return False
        try:
            if self.scheduler.has_unfinished() or not self._inbox.empty() or not self.accepting:
                return False
            self.scheduler.add_request(seq)
            with pool_released():  # this thread's OpenMP pool would slow the engine thread's regions
                self._guarded_step()
            if self.scheduler.has_unfinished():
                self._inbox.put((_WAKE, None))
            return True
        finally:
            self._step_lock.release()

    @contextlib.contextmanager
    def steps_held(self):
        """No step runs inside (a compile behind the serving runs the model meanwhile); the
        liveness clock does not count the wait as a stall."""
        with self._step_lock:
            self._liveness.held = True
            try:
                yield
            finally:
                self._liveness.resumed()

    def abort(self, request_id: str) -> None:
        """The client went away: free the request's KV blocks before the next step."""
        self._inbox.put((_ABORT, request_id))

    def load(self) -> tuple[int, int]:
        """(running, queued) right now."""
        running = self.scheduler.num_running + self._side_running
        return running, max(0, self._in_flight - running)

    def kv_usage(self) -> float:
        """The fraction of this worker's KV cache blocks held by running sequences right now."""
        return self.scheduler.kv.usage

    def kv_now(self) -> dict:
        """The KV cache's changing figures right now (`/capability` `capacity`), the host tier's too."""
        tier = self.host_tier
        return {"kv_blocks_free": self.scheduler.kv.num_free_blocks,
                **({"kv_host_tier": tier.describe()} if tier is not None else {})}

    def attach_tier(self, tier) -> None:
        """Serve prefixes past the device cache from the host tier (workers/kvtier/tier.py); a tier
        that is off is only described, with its reason."""
        self.host_tier = tier
        if tier.enabled:
            self.scheduler.kv.tier = tier

    def speculation(self) -> dict | None:
        """`/capability` and `/health` `speculative`: method, k, acceptance so far, the reason (None: not built)."""
        return None if self.speculator is None else self.speculator.describe()

    def liveness(self) -> Liveness:
        """Pending work and the age of the engine's last completed step (any thread)."""
        return self._liveness.read(self._in_flight > 0)

    @property
    def accepting(self) -> bool:
        return self._accepting and self.fatal_error is None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `drain_timeout` seconds, then
        end the rest with an error and stop the thread. Idempotent."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + drain_timeout
        while self._in_flight and self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._inbox.put((_STOP, None))
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._masker is not None:
            self._masker.shutdown(wait=False)
        if self.host_tier is not None:
            self.host_tier.close()  # what is queued is written: the next worker may read it

    # -- the engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self._num_threads)
        while not self._stopping and self.fatal_error is None:
            if self._idle():
                msg = self._wait_for_work()  # idle: sleep until a request (or a stop) arrives
                with self._step_lock:
                    self._handle(msg)
            self._guarded_step()

    def _wait_for_work(self):
        """The next inbox message, waiting for it (the engine is idle)."""
        return self._inbox.get()

    def _idle(self) -> bool:
        """Nothing to step: no sequence waits or runs."""
        return not self.scheduler.has_unfinished()

    def _guarded_step(self) -> None:
        """`step()`, where an exception (the model, or a bug) is fatal: every request gets an
        error and `on_fatal` is told."""
        try:
            self.step()
        except BaseException as exc:
            logger.exception("Engine step failed; failing %s in-flight requests", self._in_flight)
            self.fatal_error = exc
            self._abort_all(f"Engine error: {exc}")
            if self.on_fatal is not None:
                self.on_fatal(exc)

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(msg)

    def _handle(self, msg) -> None:
        kind, value = msg
        if kind == _ADD:
            self.scheduler.add_request(value)
        elif kind == _ABORT:
            seq = self.scheduler.abort_request(value)
            if seq is not None:
                self.metrics.requests.labels(seq.finish_reason).inc()
                self._release(seq)
                self._publish_load()  # no step may follow: the gauges must not wait for one
        elif kind == _STOP:
            self._stopping = True
            self._abort_all("The worker shut down before the request finished", publish=True)

    def step(self) -> int:
        """One engine step; returns the number of sequences it ran (0 when idle)."""
        with self._step_lock, torch.inference_mode():
            return self._step()

    def _step(self) -> int:
        t0 = time.perf_counter()
        self._drain_inbox()
        if self._stopping:
            return 0
        # 1. schedule (decode rows may carry draft tokens, verified in this step's forward)
        if self.speculator is not None and self.speculator.enabled:
            self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule()
        if self.host_tier is not None:  # the blocks cached so far are written while this step computes or idles
            self.host_tier.write_behind()
        if out.is_empty:
            return 0
        if self.speculator is not None and self.speculator.drafted(out):
            return self.speculator.step(self, out, t0)
        # 2. execute: one batched forward, one token per sampling chunk (plus prompt rows some
        #    asked for); the grammar masks are computed meanwhile (llguidance releases the GIL)
        seqs = [c.seq for c in out.chunks if c.samples]
        masks = self._start_masks(seqs)
        scored = prompt_chunks(out.chunks)
        if scored:
            logits, prompt_logits = self.runner.execute_with_prompt_logits(out, scored)
            for i, rows in zip(scored, prompt_logits, strict=True):
                record_prompt(out.chunks[i], rows)
        else:
            logits = self.runner.execute(out)  # [N, V]
        return self._update(out, seqs, masks, logits, t0)

    def _update(self, out, seqs: list[Sequence], masks: Future | None, logits: torch.Tensor, t0: float) -> int:
        """Sample one token per sampling chunk and apply the step (the update half of `_step`)."""
        sampled = sample_tokens(logits, seqs, self.grammars, None if masks is None else masks.result(),
                                self.scheduler.config.eos_token_ids)
        # 3. update: advance, append, detokenize, stop, stream
        updates = self.scheduler.update_from_output(out, sampled.token_ids, sampled.logprobs)
        tops = {id(s): t for s, t in zip(seqs, sampled.top, strict=True) if t is not None}
        outputs = self.output.process(updates, tops, t0)
        self._end_step(out, outputs.events, outputs.finished, len(updates), t0)
        return len(out.chunks)

    def _end_step(self, out, events: list, finished: list[Sequence], new_tokens: int, t0: float) -> None:
        """Release the finished, deliver the step's events, count the step."""
        for seq in finished:
            self._release(seq)
        if self.host_tier is not None and any(seq.publish_kv for seq in finished):
            self.host_tier.flush()  # a prefill for another worker: its blocks are readable before it reports
        deliver(events)
        self._liveness.step_done()
        seconds = time.perf_counter() - t0
        self.metrics.on_step(seconds, len(out.chunks), out, new_tokens)
        if self.speculator is not None:  # the device's measured step costs (workers/spec/cost.py)
            self.speculator.observe(out, seconds, self.metrics)
        self._publish_load()

    def _start_masks(self, seqs: list[Sequence]) -> Future | None:
        if all(s.grammar is None for s in seqs):
            return None
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._masker.submit(grammar_bitmask, seqs, self.grammars)

    def _publish_load(self) -> None:
        self.metrics.set_load(*self.load())
        if self.loras is not None:  # which adapters run and wait (workers/lora/metrics.py)
            self.lora_load = lora_load(self.scheduler)

    def _release(self, seq: Sequence) -> None:
        with self._lock:
            self._in_flight -= 1
            if seq.lora is not None:
                self.loras.release(seq.lora.name)

    def _abort_all(self, message: str, publish: bool = False) -> None:
        """End every request with an error `message`; with `publish` (a shutdown: their streams
        move to other workers) the running ones' KV is in the host tier first (workers/engine/ending.py)."""
        items = end_every_request(self.scheduler, self.host_tier, self._inbox, _ADD, self._release, message, publish)
        self._publish_load()
        deliver(items)
