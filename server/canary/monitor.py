"""The canary: do the workers still compute the same numbers?

On a mixed host each worker runs other kernels and another fp8 path, and a card can go bad
silently. Once every worker has started, when a worker process becomes ready, and every
`--canary-interval` seconds, every ready worker scores the same few short sequences and is
compared with its model's reference and with that model's other workers (what is compared:
server/canary/compare.py; the flags, series and verdicts: docs/deterministic-and-canary.md).
Design: between user requests, without displacing them: one canary request per worker at a
time, only while it has a free batch slot, not counted as load, fed to no circuit breaker and
never retried. The verdict stays apart from the breaker and the health probe (a suspect worker
answers requests fine); they meet in `/health`. Trade-off: each worker serves only once its
first check is over, so start-up waits for a round, in exchange for a round that competes with
no user request; a model's only worker serves at once, since the reference it records in that
round is its own and judges nothing yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter

from server.canary.compare import (
    Numerics,
    Reference,
    Scored,
    compare,
    consensus,
    expectation,
    parse_generation,
    parse_scores,
)
from server.config.settings import RouterSettings
from server.fleet.canary_record import FIRST_CHECK, SUSPECT, CanaryRecord
from server.fleet.client import WorkerGone
from server.fleet.handle import WorkerHandle
from server.fleet.supervisor import Supervisor
from workers.contract import GenerationParameters, WorkerRequest, WorkerState

logger = logging.getLogger(__name__)

# Short prompts whose continuations any language model can make; a few positions each.
CANARY_PROMPTS = (
    "The meaning of life is",
    "Once upon a time",
    "A fool and his money",
    "The best way to learn is",
    "In the beginning",
    "Never trust a man who",
    "Knowledge is",
    "Time flies like",
)
NEW_TOKENS = 16  # greedy tokens of each reference continuation
TOP_N = 5  # alternatives compared at each position
REQUEST_TIMEOUT_S = 30.0
SLOT_WAIT_S = 60.0  # how long a check waits for the worker to have a free batch slot
SLOT_POLL_S = 0.02
MAX_CANARY_RESTARTS = 2  # drains in a row that did not bring a worker back to health


def _model(h: WorkerHandle) -> str:
    """The model a worker serves ("" for a stand-in without one)."""
    return getattr(h, "model", "") or ""


class CanaryBusy(Exception):
    """The worker had no free batch slot, or did not answer: no verdict this time."""


class CanaryMonitor:
    """Runs the canary for one router.

    Workers of different models are never compared: each model has its own reference, recorded
    by the first round its workers take part in (at startup, or once a model loaded on demand
    has a ready worker); that round also generates each prompt's greedy continuation on every
    worker. `FIRST_CHECK` keeps each worker out of rotation until its first check is over
    (whatever the verdict in `mark` mode, and also when no verdict could be had); the router's
    "ready" line waits for it. A worker that cannot answer is the probe's business
    (server/fleet/probe.py). A worker below what is expected is marked `suspect`; with
    `--canary-action drain` it is also taken out of rotation at once (`WorkerHandle.routable`)
    and restarted gracefully, checked again before it serves, and restarted up to
    `MAX_CANARY_RESTARTS` times, then kept out of rotation and checked every interval."""

    def __init__(self, supervisor: Supervisor, settings: RouterSettings):
        self.supervisor, self.settings = supervisor, settings
        self.references: dict[str, Reference] = {}  # model name -> its reference
        self._last: dict[str, tuple[str, tuple[Scored, ...]]] = {}  # worker id -> (its model, its last scores)
        self._tried: dict[str, int] = {}  # worker id -> the process generation last checked (or tried)
        self._drains: dict[str, int] = {}  # worker id -> drains in a row without a healthy check since
        self.first_round = asyncio.Event()  # set once the start-up round is over (at once when off)

    @property
    def enabled(self) -> bool:
        return self.settings.canary_interval_s > 0

    # --- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        """Check at start-up, every interval, and each worker process once it is ready."""
        if not self.enabled:
            self.first_round.set()
            return
        serving = Counter(_model(h) for h in self.supervisor.workers.values())
        for h in self.supervisor.workers.values():  # none is ready yet: each serves after its first check,
            if serving[_model(h)] > 1:  # but a model's only worker: a reference of its own judges nothing
                self.supervisor.hold(h, FIRST_CHECK)
        await self.supervisor.wait_settled(self.settings.startup_timeout_s)
        next_round = time.monotonic()
        while True:
            if time.monotonic() >= next_round:
                await self.check(self._ready())
                self.first_round.set()
                next_round = time.monotonic() + self.settings.canary_interval_s
            else:
                due = [h for h in self._ready() if self._tried.get(h.id) != h.generation]
                if due:
                    await self.check(due)
            await self.supervisor.wait_changed(min(1.0, max(0.05, next_round - time.monotonic())))

    def _ready(self) -> list[WorkerHandle]:
        """Workers that can answer now: ready, whether or not the canary holds them out of rotation."""
        return [h for h in self.supervisor.workers.values()
                if h.state == WorkerState.READY and h.client is not None and h.info is not None]

    async def check(self, handles: list[WorkerHandle]) -> None:
        """One canary check of `handles` (all in parallel, each one request at a time)."""
        if not handles:
            return
        for h in handles:
            self._tried[h.id] = h.generation
        by_model: dict[str, list[WorkerHandle]] = {}
        for h in handles:
            by_model.setdefault(_model(h), []).append(h)
        try:
            await asyncio.gather(*(self._check_model(model, group) for model, group in by_model.items()))
        finally:  # checked (or no verdict could be had): a first check never keeps a worker out
            self.release_first_checks(handles)

    async def _check_model(self, model: str, handles: list[WorkerHandle]) -> None:
        """Check workers of one model against its reference (recorded first if it has none)."""
        reference = self.references.get(model)
        if reference is None:
            await self._record_reference(model, handles)
            return
        results = await asyncio.gather(*(self._score_all(h, reference.sequences) for h in handles),
                                       return_exceptions=True)
        for h, result in zip(handles, results, strict=True):
            self._conclude(h, result)

    def release_first_checks(self, handles) -> None:
        """Back in rotation: each of `handles` held only for its first check."""
        for h in handles:
            if h.canary_hold == FIRST_CHECK:
                self.supervisor.release(h)

    # --- the reference -----------------------------------------------------------------
    async def _record_reference(self, model: str, handles: list[WorkerHandle]) -> None:
        """The first round: every worker generates the continuations, the consensus becomes the
        canary sequences, every worker scores them, and the worker that agreed with the
        consensus on the most prompts (the first such in device order) gives the reference."""
        generations = await asyncio.gather(*(self._generate_all(h) for h in handles), return_exceptions=True)
        answered = [(h, g) for h, g in zip(handles, generations, strict=True) if not isinstance(g, BaseException)]
        for h, g in zip(handles, generations, strict=True):
            if isinstance(g, BaseException):
                logger.warning("canary: worker %s could not generate the reference: %s", h.id, g)
        if not answered:
            return
        continuations = [g for _, g in answered]
        picks = consensus(continuations)
        sequences = tuple(continuations[w][p] for p, w in enumerate(picks))
        agreeing = [sum(c[p] == sequences[p] for p in range(len(sequences))) for c in continuations]
        results = await asyncio.gather(*(self._score_all(h, sequences) for h, _ in answered), return_exceptions=True)
        order = sorted(range(len(answered)), key=lambda i: -agreeing[i])  # stable: device order among ties
        origin = next((i for i in order if not isinstance(results[i], BaseException)), None)
        if origin is None:
            return
        h0 = answered[origin][0]
        assert h0.info is not None
        self.references[model] = Reference(model or h0.info.model.id or str(self.settings.model_dir), sequences,
                                           results[origin], h0.id, Numerics.of(h0.info), time.time())
        logger.info("canary: reference of %s recorded from worker %s (%d sequences, %d positions)",
                    model or "the model", h0.id, len(sequences), sum(len(s.positions) for s in results[origin]))
        for (h, _), result in zip(answered, results, strict=True):
            self._conclude(h, result)

    # --- talking to a worker -----------------------------------------------------------
    async def _free_slot(self, h: WorkerHandle) -> None:
        """Return once the router has fewer than `--max-batch` requests in flight at `h`."""
        deadline = time.monotonic() + SLOT_WAIT_S
        while h.outstanding >= self.settings.max_batch:
            if time.monotonic() > deadline:
                raise CanaryBusy(f"no free batch slot for {SLOT_WAIT_S:g}s")
            await asyncio.sleep(SLOT_POLL_S)

    async def _post(self, h: WorkerHandle, body: WorkerRequest) -> dict:
        await self._free_slot(h)
        client = h.client
        if client is None:
            raise CanaryBusy("the worker went away")
        try:
            status, _, content = await asyncio.wait_for(client.post("/generate", body), REQUEST_TIMEOUT_S)
        except WorkerGone as e:
            raise CanaryBusy(f"no answer: {e!r}") from e
        if status != 200:
            raise CanaryBusy(f"answered {status}: {content[:200]!r}")
        return json.loads(content)

    async def _generate_all(self, h: WorkerHandle) -> list[tuple[int, ...]]:
        """Each canary prompt's token ids followed by its greedy continuation on `h`."""
        out = []
        for prompt in CANARY_PROMPTS:
            body = await self._post(h, WorkerRequest(inputs=prompt, parameters=GenerationParameters(
                max_new_tokens=NEW_TOKENS, do_sample=False, details=True, decoder_input_details=True)))
            prompt_ids, generated = parse_generation(body)
            out.append(tuple(prompt_ids + generated))
        return out

    async def _score_all(self, h: WorkerHandle, sequences) -> tuple[Scored, ...]:
        """`h`'s scores of each sequence, teacher-forced (one prefill each, nothing generated)."""
        out = []
        for seq in sequences:
            body = await self._post(h, WorkerRequest(input_ids=tuple(seq), parameters=GenerationParameters(
                max_new_tokens=0, details=True, decoder_input_details=True, top_n_tokens=TOP_N)))
            out.append(parse_scores(body))
        return tuple(out)

    # --- verdicts and actions ----------------------------------------------------------
    def _conclude(self, h: WorkerHandle, result) -> None:
        if isinstance(result, BaseException):
            logger.warning("canary: no verdict on worker %s this time: %s", h.id, result)
            return
        model = _model(h)
        ref = self.references.get(model)
        assert ref is not None and h.info is not None
        self._last[h.id] = (model, result)
        c = compare(result, ref.scores)
        exp = expectation(Numerics.of(h.info), ref.numerics, self.settings.canary_min_agreement)
        verdict, reason = exp.judge(c)
        peers = tuple((other, compare(result, scores).agreement) for other, (of, scores) in self._last.items()
                      if other != h.id and of == model)
        h.canary = CanaryRecord(h.generation, time.time(), verdict, reason, exp.describe(), c.agreement,
                                c.max_logprob_diff, c.positions, ref.describe(), peers)
        if verdict == SUSPECT:
            logger.error("canary: worker %s is suspect: %s", h.id, reason)
            if self.settings.canary_action == "drain":
                self._drain(h, reason)
            return
        self._drains.pop(h.id, None)
        if h.canary_hold is not None:
            logger.info("canary: worker %s passed its check (%s); back in rotation", h.id, reason)
            self.supervisor.release(h)

    def _drain(self, h: WorkerHandle, reason: str) -> None:
        drains = self._drains.get(h.id, 0)
        if drains >= MAX_CANARY_RESTARTS:
            self.supervisor.hold(h, f"canary: suspect after {drains} restarts ({reason})")
            return
        self._drains[h.id] = drains + 1
        self.supervisor.hold(h, f"canary: suspect ({reason})", restart=True)


async def run_canary(monitor: CanaryMonitor) -> None:
    """The app's background task: the canary loop, whose failure is logged, never fatal."""
    with contextlib.suppress(asyncio.CancelledError):
        try:
            await monitor.run()
        except Exception:
            logger.exception("the canary stopped")
            monitor.release_first_checks(monitor.supervisor.workers.values())
            monitor.first_round.set()
