"""Output processing: one step's sampled tokens -> the events each request's stream gets.

Design: the second half of the engine's update. The scheduler has appended each token and ended
sequences on EOS or length (workers/engine/scheduler.py); per token this processor detokenizes
and finds stop strings (workers/contract/detokenize.py), ends a sequence on a completed stop
string or a complete grammar (a grammar at a dead end, EOS drawn while incomplete, ends the
request with a `validation` error instead of an answer that violates it), stamps the first
token's time, builds `FinishInfo` on a finish and makes the `TokenEvent`. Trade-off: stop strings
and grammar ends are found one step late for the scheduler (after it appended the token), which
costs nothing: a finished sequence is simply not scheduled again."""

from __future__ import annotations

import time
from dataclasses import dataclass

from workers.contract.errors import ERROR_VALIDATION
from workers.engine.events import ErrorEvent, FinishInfo, RequestStream, RequestTimings, TokenEvent
from workers.engine.metrics import WorkerMetrics
from workers.engine.scheduler import Scheduler
from workers.engine.scheduler_output import TokenUpdate
from workers.engine.sequence import FINISH_EOS, FINISH_STOP, Sequence
from workers.sampling.grammar import advance
from workers.sampling.logprobs import TopList

_DEAD_END = ("The grammar cannot be completed: no token can continue the output it allows (for example text "
             "that only a special token spells). Accepted: a grammar whose output ordinary tokens can write")


def _ending_dropped(seq: Sequence, token_id: int) -> bool:
    """Whether the EOS or stop token id that ends `seq` stays out of its text: when the request
    keeps no stop text (vLLM's `include_stop_str_in_output` false) and the token's text would
    be in it (an ordinary token, or any with `skip_special_tokens` false). A special token's
    text is otherwise streamed flagged `special` (the router reads harmony's tags from it)."""
    p = seq.params
    return not p.include_stop_str_in_output and (not p.skip_special_tokens or not seq.detok.is_special(token_id))


def _stop_reason(seq: Sequence, u: TokenUpdate, reason: str) -> str | int | None:
    """What stopped it (vLLM's `stop_reason`): the stop string matched, or the stop token id."""
    if reason != FINISH_STOP:
        return None
    return seq.detok.stop_hit if seq.detok.stopped else u.token_id


@dataclass(frozen=True)
class StepOutputs:
    """What one step gives the HTTP side: an event per sampled token, and who finished."""

    events: list[tuple[RequestStream, TokenEvent | ErrorEvent]]
    finished: list[Sequence]


def request_timings(seq: Sequence, finished: float) -> RequestTimings:
    """Where the request's time went (monotonic clock): queue, the first token's step, the rest."""
    prefill_started = seq.stream.prefill_started or seq.arrival_time
    first = seq.first_token_time or finished
    return RequestTimings(max(0.0, prefill_started - seq.arrival_time), first - prefill_started, finished - first)


class OutputProcessor:
    """Turns `TokenUpdate`s into events (see the module docstring); engine thread only."""

    def __init__(self, scheduler: Scheduler, metrics: WorkerMetrics):
        self.scheduler, self.metrics = scheduler, metrics

    def process(self, updates: list[TokenUpdate], tops: dict[int, TopList], step_started: float) -> StepOutputs:
        """`tops`: the alternatives per `id(sequence)`; `step_started`: the step's `perf_counter`."""
        now = time.monotonic()
        # perf_counter and monotonic share a clock on Linux, but not everywhere: convert once.
        step_started = now - (time.perf_counter() - step_started)
        events, finished = [], []
        for u in updates:
            seq = u.seq
            # 1. text, and 2. the ends the scheduler cannot see: a stop string, a complete grammar
            reason = u.finish_reason
            if seq.grammar is not None and reason == FINISH_EOS and not seq.grammar.is_accepting():
                self.metrics.requests.labels("grammar_dead_end").inc()
                finished.append(seq)
                events.append((seq.stream, ErrorEvent(_DEAD_END, ERROR_VALIDATION)))
                continue
            if reason in (FINISH_EOS, FINISH_STOP) and _ending_dropped(seq, u.token_id):
                text, special = "", False  # the EOS or stop token id that ends it, left out of the text
            else:
                text, special = seq.detok.add(u.token_id)
            if seq.detok.stopped:
                reason = FINISH_STOP
                self.scheduler.finish(seq, FINISH_STOP)
            elif seq.grammar is not None and advance(seq.grammar, u.token_id) and reason is None:
                reason = FINISH_EOS  # the grammar is complete: only EOS could follow
                self.scheduler.finish(seq, FINISH_EOS)
            # 3. the first token
            if seq.first_token_time is None:
                seq.first_token_time = now
                seq.stream.prefill_started = step_started
                self.metrics.ttft.observe(now - seq.arrival_time)
            # 4. the finish
            finish = None
            if reason is not None:
                text += seq.detok.flush()
                finish = FinishInfo(reason, seq.detok.text, len(seq.output_ids), len(seq.prompt_ids), seq.seed,
                                    request_timings(seq, now), _stop_reason(seq, u, reason))
                self.metrics.requests.labels(reason).inc()
                self.metrics.e2e.observe(now - seq.arrival_time)
                finished.append(seq)
            # 5. the event
            index = len(seq.output_ids) - 1
            prefill = tuple(seq.prompt_logprobs) if index == 0 and seq.prompt_logprobs is not None else None
            events.append((seq.stream, TokenEvent(index, u.token_id, text, u.logprob, special, finish,
                                                  tops.get(id(seq)), prefill)))
        return StepOutputs(events, finished)
