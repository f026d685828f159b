"""Disaggregated prefill: a long prompt computed on a prefill worker, its decode on another.

Design: a stream whose prompt has at least `--disaggregate-min-prompt` tokens goes first to a
worker of role `prefill` (server/routing/roles.py) with `publish_kv` set: that worker computes the
prompt, samples the first token, writes every block of the prompt (the partly filled last one
too) to the host KV tier (workers/kvtier/), and only then reports that token, as a token event
that does not end the answer (server/fleet/text.py), and ends its stream. The router relays the
token to the client at once, then sends the same request to a decode worker with that token as
`resume_ids`, exactly as a migrated stream continues (server/dispatch/migration.py): its prefix
lookup finds the prompt's blocks in the tier and copies them in instead of recomputing them, and
its seeded generator, stop strings, logprobs and `max_new_tokens` go on from the second token.
A first token that ends the answer (EOS, a stop) ends it on the prefill worker. Faults: no prefill
worker ready, busy, refusing (5xx) or lost before its token -> the request runs as without
disaggregation (its prompt recomputed on a decode worker), named in the log and in
`hetserve_disagg_fallback_total{reason}`; a lost decode worker migrates as any stream. Only
streams are handed off: a non-streamed answer has no first token to send early. Trade-off: the
prompt is tokenized once more here to measure it (the prefill worker's channel tokenizes it
again), a cost paid only by prompts whose UTF-8 bytes could reach the threshold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import anyio
from prometheus_client import CollectorRegistry, Counter

from server.config.disaggregate import AUTO
from server.config.settings import RouterSettings
from server.dispatch.dispatcher import Dispatcher, DispatchError, WorkerReply, WorkerStream
from server.dispatch.migration import ClientStream, StreamIncomplete, is_final, parse_event, token_ids
from server.fleet.channel import STREAM_PATH
from server.fleet.client import WorkerGone
from server.fleet.handle import WorkerHandle
from server.fleet.spec import worker_id
from server.fleet.text import INLINE_PROMPT_CHARS
from server.routing.filter import ELIGIBLE, Constraints, eligible
from server.routing.policy import HEADER_ROUTE
from server.routing.roles import BOTH, DECODE, PREFILL, Roles, resolve_roles
from server.routing.router import Router
from server.routing.split import LOCAL, MIN_SAMPLES, PART, Side, Split, measured_roles, plan
from workers.contract import RESUME_IDS, DeviceInfo, WorkerRequest, cpu_device
from workers.contract.errors import is_request_fault
from workers.contract.slowdown import ENV_SLOWDOWN, device_slowdown

logger = logging.getLogger(__name__)

_ERROR_PREFIX = '{"error"'
_SPECIAL_TOKENS_SLACK = 8  # tokens a tokenizer may add to a text (BOS, a template's own)
# why a request that qualified was not handed off (`hetserve_disagg_fallback_total{reason}`)
FALLBACK_REASONS = ("no_prefill_worker", "no_decode_worker", "no_token_channel", "prefill_unavailable",
                    "prefill_refused", "prefill_lost", "prefill_timeout")
# what became of a long-prompt stream the roles would hand off (`hetserve_disagg_requests_total{outcome}`)
SPLIT_AFTER_S = 20.0  # a measured split (or a new prefill worker) must hold this long before it applies
OUTCOMES = ("handed_off", "ended_on_prefill", "split", "kept_local", "decoded_on_prefill")


class Disaggregation:
    """The roles, the threshold and the handoff's counters; `open` runs one stream's handoff."""

    def __init__(self, roles: Roles, min_prompt_tokens: int, capacity: int,
                 registry: CollectorRegistry | None = None, measured: bool = False, timeout_s: float = 30.0):
        self.roles, self.min_prompt_tokens, self.capacity = roles, min_prompt_tokens, capacity
        self.prior = roles  # the start's roles, from the cards' published figures
        self.measured = measured  # `auto`: the roles follow the measured speeds once every worker has them
        self.timeout_s = timeout_s  # the most a prefill worker may take to publish a prompt's blocks
        self._proposed: tuple[str, float] | None = None  # the prefill worker measured, and since when
        self.requests = Counter("hetserve_disagg_requests", "Long-prompt streams under disaggregated prefill, by "
                                "outcome (handed_off to a decode worker, ended_on_prefill by its first token, "
                                "split: part of the prompt prefilled on another worker, kept_local: prefilled "
                                "where it decodes, which the measured queues said was sooner, decoded_on_prefill: "
                                "an answer short enough to decode where it was prefilled).",
                                ["outcome"], registry=registry)
        self.fallbacks = Counter("hetserve_disagg_fallback", "Long-prompt streams that were not handed off and "
                                 "were prefilled on a decode worker instead, by reason.", ["reason"], registry=registry)

    def refresh(self, router: Router, workers: Iterable[WorkerHandle]) -> Roles:
        """Under `auto`, the roles the measured speeds give now (server/routing/split.py
        `measured_roles`), logged when they change; the start's roles until every routable worker
        is measured. Explicit roles stay as given."""
        if not self.measured:
            return self.roles
        ids = sorted(h.id for h in workers if h.routable)
        m = measured_roles({w: router.telemetry.phases(w) for w in ids}, self.roles.active, self.prior.active)
        if m is None:
            return self.roles
        roles = Roles({w: BOTH if w == m.prefill else DECODE for w in ids} if m.prefill else {}, m.reason)
        changed = dict(roles.by_worker) != dict(self.roles.by_worker)
        if not (changed and m.prefill is not None):
            self._proposed = None  # nothing new proposed: a later split waits its full time again
        elif not self._held(m.prefill):
            return self.roles  # a new prefill worker: only once measured so for `SPLIT_AFTER_S`
        if changed:
            logger.info("disaggregated prefill: roles now %s", m.reason)
        self.roles = roles
        return roles

    def _held(self, prefill: str) -> bool:
        """Whether the measurements have named `prefill` the prefill worker for `SPLIT_AFTER_S` in a
        row: a split (or a move of it) follows a lasting difference, not a few noisy intervals (a
        shared host's contention alone once measured an advantage of 4 between identical workers)."""
        now = time.monotonic()
        if self._proposed is None or self._proposed[0] != prefill:
            self._proposed = (prefill, now)
        return now - self._proposed[1] >= SPLIT_AFTER_S

    def describe(self, worker_id: str) -> dict:
        """`/workers` `disaggregation`: this worker's role and why the roles are what they are."""
        return {"role": self.roles.role(worker_id), "reason": self.roles.reason,
                "min_prompt_tokens": self.min_prompt_tokens}

    # --- who may take what -------------------------------------------------------------
    def _only(self, role: str, workers: Iterable[WorkerHandle]) -> dict[str, int]:
        """Workers of exactly `role`, as an exclusion (id -> generation)."""
        return {h.id: h.generation for h in workers if self.roles.role(h.id) == role}

    def held_back(self, workers: Iterable[WorkerHandle], c: Constraints) -> dict[str, int]:
        """What an ordinary request excludes: the prefill-only workers, while another is routable
        (none for a request that names its worker)."""
        if c.worker is not None:
            return {}
        workers = list(workers)
        prefill = self._only(PREFILL, workers)
        if prefill and any(h.routable and h.id not in prefill for h in workers):
            return prefill
        return {}

    def _fallback(self, reason: str, detail: str) -> None:
        self.fallbacks.labels(reason).inc()
        logger.warning("disaggregated prefill fell back to a decode worker (%s): %s", reason, detail)

    # --- the decision --------------------------------------------------------------------
    async def _prompt_ids(self, workers: list[WorkerHandle], body: WorkerRequest) -> tuple[int, ...] | int | None:
        """The prompt's token ids, as the workers tokenize it; None when it cannot reach the
        threshold (its UTF-8 bytes are too few) or no worker gives its tokenizer, -1 when the
        workers render their streams themselves."""
        if body.input_ids is not None:
            return body.input_ids if len(body.input_ids) >= self.min_prompt_tokens else None
        if len(body.inputs.encode()) + _SPECIAL_TOKENS_SLACK < self.min_prompt_tokens:
            return None
        for h in workers:
            if not h.routable or h.client is None:
                continue
            try:
                model = await h.client.text_model()
            except WorkerGone:
                continue
            if model is None:
                return -1  # the worker renders its streams: its one-token prefill would end the answer
            text = body.inputs
            encode = model.tokenizer.encode
            return tuple((await asyncio.to_thread(encode, text) if len(text) > INLINE_PROMPT_CHARS
                          else encode(text)).ids)
        return None  # no worker is up to ask: the request waits for one as any other

    async def _plan(self, workers: list[WorkerHandle], router: Router, path: str, body,
                    c: Constraints) -> tuple[tuple[int, ...], Split | None] | None:
        """The prompt's ids and how it is split (None: by the roles alone, some worker is not
        measured yet) when this request is handed off, else None (counted as a fallback when it
        was long enough, or as `kept_local` when the measured queues say a decode worker is sooner)."""
        roles = self.refresh(router, workers)
        if not roles.active or path != STREAM_PATH or not isinstance(body, WorkerRequest) or c.worker:
            return None
        p = body.parameters
        if body.resume_ids or body.publish_kv or p.max_new_tokens <= 1 or p.decoder_input_details:
            return None
        mine = [h for h in workers if c.model is None or h.model == c.model]
        ids = await self._prompt_ids(mine, body)
        if ids is None or (ids != -1 and len(ids) < self.min_prompt_tokens):
            return None
        if ids == -1:
            self._fallback("no_token_channel", "no worker renders its streams in the router")
            return None
        ready = {}
        for reason, role, exclude in (("no_prefill_worker", PREFILL, self._only(DECODE, mine)),
                                      ("no_decode_worker", DECODE, self._only(PREFILL, mine))):
            f = eligible(mine, c, self.capacity, exclude)
            if f.kind != ELIGIBLE:
                self._fallback(reason, f.reason)
                return None
            ready[role] = f.workers
        split = self._split(router, ready[PREFILL], ready[DECODE], len(ids), p.max_new_tokens)
        if split is not None and split.kind == LOCAL:
            self.requests.labels("kept_local").inc()
            logger.info("disaggregated prefill: a %d-token prompt stays on a decode worker: %s", len(ids), split.reason)
            return None
        return ids, split

    def _split(self, router: Router, prefill: Sequence[WorkerHandle], decode: Sequence[WorkerHandle],
               n: int, new_tokens: int) -> Split | None:
        """server/routing/split.py `plan` over the workers that may take each part now, from their
        measured speeds and the prompt work in flight there; None while one is not measured."""
        sides, block = {}, None
        for h in (*prefill, *decode):
            speed = router.telemetry.phases(h.id)
            if speed is None or speed.samples < MIN_SAMPLES:
                return None
            size = (h.info.capacity if h.info is not None else {}).get("kv_block_size")
            block = size if isinstance(size, int) and size > 0 and (block is None or size == block) else block
            sides[h.id] = Side(h.id, h in prefill, h in decode, speed.prefill_s,
                               router.inflight(h.id)[0] * speed.prefill_s, speed.sequence_s)
        return plan(list(sides.values()), n, block or 16, new_tokens)

    def _route(self, workers: Iterable[WorkerHandle], to: str) -> dict[str, int]:
        """An exclusion that leaves only worker `to`."""
        return {h.id: h.generation for h in workers if h.id != to}

    # --- the handoff -----------------------------------------------------------------------
    async def open(self, dispatcher: Dispatcher, path: str, body, c: Constraints) -> ClientStream | WorkerReply | None:
        """The client stream of a handed-off request (its first event from the prefill worker, or
        from the decode worker after part of its prompt was prefilled elsewhere), the prefill
        worker's answer when it blames the request, or None: not handed off."""
        workers = list(dispatcher.supervisor.workers.values())
        planned = await self._plan(workers, dispatcher.router, path, body, c)
        if planned is None:
            return None
        ids, split = planned
        if split is not None and split.kind == PART:
            return await self._open_part(dispatcher, path, body, c, ids, split)
        if split is not None and split.stays:
            return await self._open_here(dispatcher, path, body, c, split)
        n = len(ids)
        exclude = self._only(DECODE, workers) if split is None else self._route(workers, split.prefill)
        prefill_body = body.model_copy(update={"publish_kv": True})
        try:
            with anyio.fail_after(self.timeout_s):
                opened = await dispatcher.open_stream(path, prefill_body, c, exclude, wait=False)
        except TimeoutError:
            self._fallback("prefill_timeout", f"no first token within {self.timeout_s:g} s "
                                              "(--disaggregate-timeout): the prompt is computed on a decode worker")
            return None
        except DispatchError as e:
            self._fallback("prefill_unavailable", e.message)
            return None
        if isinstance(opened, WorkerReply):
            if opened.status < 500:
                return opened  # the request's own fault (422, an unknown adapter): a decode worker says the same
            self._fallback("prefill_refused", f"worker {opened.worker.id} answered {opened.status}")
            return None
        last = opened.first_data
        if last.startswith(_ERROR_PREFIX) and not is_request_fault((parse_event(last) or {}).get("error_type")):
            self._fallback("prefill_lost", f"worker {opened.worker.id}: {last[:200]}")
            opened.worker.request_outcome(opened.generation, False, "error event on a prefill")
            with anyio.CancelScope(shield=True):
                await opened.aclose()
            return None
        why = f"; {split.reason}" if split is not None else ""
        opened.headers[HEADER_ROUTE.lower()] = (f"disaggregated: prefill on {opened.worker.id} ({n} prompt tokens "
                                                f">= {self.min_prompt_tokens}{why}), decode on a decode worker")
        if last.startswith(_ERROR_PREFIX) or is_final(parse_event(last)):
            self.requests.labels("ended_on_prefill").inc()  # its first token ended it (or it was refused)
            return ClientStream(dispatcher, path, body, c, opened)
        return HandoffStream(dispatcher, path, body, c, opened, self)

    async def _open_on(self, dispatcher: Dispatcher, path: str, body: WorkerRequest, c: Constraints, worker: str,
                       outcome: str, route: Callable[[str], str]) -> ClientStream | WorkerReply | None:
        """The client's request as an ordinary stream on `worker` only, `route(its id)` its
        `X-Hetserve-Route`, counted as `outcome`; None when that worker went away meanwhile (then
        it is routed as any request)."""
        workers = list(dispatcher.supervisor.workers.values())
        try:
            opened = await dispatcher.open_stream(path, body, c, self._route(workers, worker), wait=False)
        except DispatchError:
            return None
        if isinstance(opened, WorkerReply):
            return opened
        opened.headers[HEADER_ROUTE.lower()] = route(opened.worker.id)
        self.requests.labels(outcome).inc()
        return ClientStream(dispatcher, path, body, c, opened)

    async def _open_here(self, dispatcher: Dispatcher, path: str, body: WorkerRequest, c: Constraints,
                         split: Split) -> ClientStream | WorkerReply | None:
        """The whole request on the prefill worker, as an ordinary stream: its answer is short
        enough that decoding it there costs less than moving its blocks."""
        return await self._open_on(dispatcher, path, body, c, split.prefill, "decoded_on_prefill",
                                   lambda w: f"disaggregated: prefill and decode on {w} ({split.reason})")

    async def _open_part(self, dispatcher: Dispatcher, path: str, body: WorkerRequest, c: Constraints,
                         ids: tuple[int, ...], split: Split) -> ClientStream | WorkerReply | None:
        """`split.tokens` of the prompt prefilled on `split.prefill` (its blocks published, its one
        sampled token dropped), then the whole request on `split.decode`, which reads those blocks
        from the tier and computes the rest; a part that fails or times out only leaves more to
        compute there."""
        workers = list(dispatcher.supervisor.workers.values())
        params = body.parameters.model_copy(update={"max_new_tokens": 1, "details": False})
        part = body.model_copy(update={"inputs": "", "input_ids": ids[:split.tokens], "parameters": params,
                                       "publish_kv": True})
        done = await self._prefill_part(dispatcher, path, part, c, self._route(workers, split.prefill))
        what = "prefilled" if done else "not prefilled (see the log)"
        return await self._open_on(dispatcher, path, body, c, split.decode, "split",
                                   lambda w: f"disaggregated: {split.tokens} of {len(ids)} prompt tokens {what} on "
                                             f"{split.prefill}, the rest and the decode on {w} ({split.reason})")

    async def _prefill_part(self, dispatcher: Dispatcher, path: str, part: WorkerRequest, c: Constraints,
                            exclude: dict[str, int]) -> bool:
        """Run one partial prefill to its end within the timeout; whether it ended cleanly."""
        opened = None
        try:
            with anyio.fail_after(self.timeout_s):
                opened = await dispatcher.open_stream(path, part, c, exclude, wait=False)
                if isinstance(opened, WorkerReply):
                    self._fallback("prefill_refused", f"worker {opened.worker.id} answered {opened.status}")
                    return False
                last = None
                async for data in opened.events():
                    last = data
                if last is None or last.startswith(_ERROR_PREFIX):
                    self._fallback("prefill_lost", f"worker {opened.worker.id}: {(last or 'no event')[:200]}")
                    return False
                return True
        except TimeoutError:
            self._fallback("prefill_timeout", f"a partial prefill took over {self.timeout_s:g} s "
                                              "(--disaggregate-timeout): the decode worker computes it")
            return False
        except (DispatchError, *WorkerGone) as e:
            self._fallback("prefill_unavailable", getattr(e, "message", repr(e)))
            return False
        finally:
            if isinstance(opened, WorkerStream):
                with anyio.CancelScope(shield=True):
                    await opened.aclose()


class HandoffStream(ClientStream):
    """A client stream whose first token came from a prefill worker and whose rest comes from a
    decode worker; afterwards a stream like any other (it migrates when its worker is lost)."""

    def __init__(self, dispatcher: Dispatcher, path: str, body: WorkerRequest, c: Constraints,
                 first: WorkerStream, handoff: Disaggregation):
        super().__init__(dispatcher, path, body, c, first)
        self.handoff = handoff

    async def _relayed(self):
        prefill = self.stream
        self._keep(prefill.first_raw)
        yield prefill.first_raw  # the first token, to the client at once
        try:
            more = await prefill.sse.next_batch()
        except WorkerGone:
            more = None  # it reported its token after publishing the blocks: its end is not needed
        if more is not None:  # it went on generating (it does not know `publish_kv`): an ordinary stream
            prefill.first_raw, prefill.first_data = more
            async for raw in super()._relayed():
                yield raw
            return
        prefill.finish()
        with anyio.CancelScope(shield=True):
            await prefill.aclose()
        self.stream = await self._decode_stream(prefill)
        async for raw in super()._relayed():
            yield raw

    async def _decode_stream(self, prefill: WorkerStream) -> WorkerStream:
        """The continuation on a decode worker (a worker that also prefills when none can)."""
        self._delivered.extend(token_ids(self._segment))
        self._segment, self._segment_bytes = [], 0
        body = self.body.model_copy(update={RESUME_IDS: tuple(self._delivered)})
        workers = self.dispatcher.supervisor.workers.values()
        lost = f"the prefill on worker {prefill.worker.id} sent {len(self._delivered)} token(s)"
        opened = None
        # first not the prefill worker (decode goes where memory is), nor one that only prefills
        first = {**self.handoff._only(PREFILL, workers), prefill.worker.id: prefill.worker.generation}
        for exclude in (first, {}):
            try:
                opened = await self.dispatcher.open_stream(self.path, body, self.constraints,
                                                           {**exclude, **self._exclude}, self._deaths)
                break
            except DispatchError as e:
                why = e.message
        if opened is None:
            raise StreamIncomplete(f"{lost}; no worker could continue it: {why}")
        if isinstance(opened, WorkerReply):
            detail = (parse_event(opened.content.decode("utf-8", errors="replace")) or {}).get("error")
            raise StreamIncomplete(f"{lost}; worker {opened.worker.id} refused to continue it "
                                   f"({opened.status}: {detail or 'no message'})")
        self.handoff.requests.labels("handed_off").inc()
        return opened


def disaggregation(settings: RouterSettings, devices: Sequence[DeviceInfo], assignment: Mapping[int, object],
                   registry: CollectorRegistry | None = None) -> Disaggregation | None:
    """The handoff for `settings.disaggregate` over the workers `assignment` starts (device index
    -> model), or None when it is off; `UsageError` for roles that name no worker. The roles
    are logged once with their reason."""
    config = settings.disaggregate
    if not config.enabled:
        return None
    workers = {worker_id(d): d for d in (devices or [cpu_device()]) if not assignment or d.index in assignment}
    spec = os.environ.get(ENV_SLOWDOWN, "")  # simulated devices slowed on purpose, as the workers are
    slowed = {w: device_slowdown(spec, w, d.simulated, d.arch) for w, d in workers.items()} if spec else None
    roles = resolve_roles(config, workers, slowed)
    logger.info("disaggregated prefill: %s; prompts from %d tokens are handed off", roles.reason,
                config.min_prompt_tokens)
    return Disaggregation(roles, config.min_prompt_tokens, settings.worker_capacity, registry,
                          measured=config.mode == AUTO, timeout_s=config.timeout_s)
