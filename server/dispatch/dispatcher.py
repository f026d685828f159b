"""Sends one request to a worker and makes sure it ends in a result or a clear error.

Nothing is lost: a request is retried on another ready worker when its worker fails before the
client has received anything (unreachable, dead, 503, 429; another 5xx once), while an answer
that blames the request is the answer (server/dispatch/faults.py), and a stream whose first
event has gone out moves instead (server/dispatch/migration.py); what each failure does:
docs/serving.md. When every matching worker is busy the answer is 429 with `Retry-After`; when
none is ready (one restarting after a crash, or a model loading on demand through
server/fleet/models.py) the request waits a bounded time for one, then gets 503. Every outcome
feeds the worker's circuit breaker (`Dispatcher._judge`). Trade-off: a stream's headers are sent
only with its first event, so a retry is invisible to the client at the price of holding the
response until the first token exists.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from server.config.settings import RouterSettings
from server.dispatch.faults import REFUSED_TYPE, Deaths, Quarantine, fingerprint, request_fault
from server.dispatch.spans import note_answer, note_retry, note_route
from server.fleet.client import SSEEvents, WorkerDown, WorkerGone, split_events
from server.fleet.handle import WorkerHandle
from server.fleet.metrics import RouterMetrics
from server.fleet.models import ModelManager, ModelUnavailable
from server.fleet.supervisor import Supervisor
from server.routing.filter import ELIGIBLE, OVERLOADED, UNLOADED, UNSATISFIABLE, WAIT, Constraints, eligible
from server.routing.policy import HEADER_ROUTE
from server.routing.router import Router, RouteRequest, Ticket
from workers.contract import (
    HEADER_FP8_CONVENTION,
    HEADER_MODEL,
    HEADER_WORKER_CAPABILITY,
    HEADER_WORKER_ID,
    WORKER_HEADERS,
    WireRequest,
    WorkerRequest,
)
from workers.contract.tracing import NO_TRACING, Tracing

logger = logging.getLogger(__name__)

_RETRY_STATUSES = (429, 503)  # the worker did not take the request: try another


def _retry(status: int, error_retried: bool, fault: bool = False) -> tuple[bool, bool]:
    """(retry elsewhere?, error retry used?). 429/503: always; another 5xx: once (the worker may
    be failing, as before a fatal exit) unless it blames the request (`fault`); anything else is
    the answer."""
    if fault:
        return False, error_retried
    if status in _RETRY_STATUSES:
        return True, error_retried
    if status >= 500 and not error_retried:
        return True, True
    return False, error_retried




class _Lost(Exception):
    """The worker went away before the client received anything: try another. `died`: it went
    away with the request in flight (not: nothing listened)."""

    def __init__(self, why: str, died: bool = True):
        super().__init__(why)
        self.why, self.died = why, died


class DispatchError(Exception):
    """The router answers this itself (no worker produced a response)."""

    def __init__(self, status: int, message: str, error_type: str, retry_after: int | None = None,
                 model: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.retry_after = retry_after
        self.model = model  # the model the request was for (`X-Hetserve-Model` on the answer)


@dataclass
class WorkerReply:
    """A worker's complete (non-streamed) answer, or its refusal of a stream."""

    status: int
    content: bytes
    headers: dict[str, str]
    worker: WorkerHandle


@dataclass
class WorkerStream:
    """An open stream whose first event has arrived; `aclose()` exactly once, always.

    `first_raw` holds the first complete event(s) as the worker sent them and `first_data`
    the last of those events' payload; `sse` yields what follows.
    """

    worker: WorkerHandle
    headers: dict[str, str]
    first_raw: bytes
    first_data: str
    sse: SSEEvents
    _stack: contextlib.AsyncExitStack
    _closed: bool = field(default=False)

    generation: int = 0  # the worker process that serves it
    ticket: Ticket | None = None  # its dispatch, ended with the stream

    def finish(self) -> None:
        """The worker sent its last event: its admission slot is free, whether or not the client
        has read everything yet."""
        if self.ticket is not None:
            self.ticket.end()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.finish()
            await self._stack.aclose()

    async def events(self) -> AsyncIterator[str]:
        """Every event's data payload, the first ones included."""
        for data in split_events(self.first_raw):
            yield data
        async for data in self.sse.events():
            yield data


def worker_headers(worker: WorkerHandle, response_headers) -> dict[str, str]:
    """X-Worker-Id, X-Worker-Capability, X-Fp8-Convention: the worker's, else what the router knows."""
    fallback = {
        HEADER_WORKER_ID: worker.id,
        HEADER_WORKER_CAPABILITY: worker.capability_label,
        HEADER_FP8_CONVENTION: worker.fp8_label or "unknown",
    }
    headers = {name.lower(): response_headers.get(name.lower()) or fallback[name] for name in WORKER_HEADERS}
    headers[HEADER_MODEL.lower()] = worker.model
    return headers


class Dispatcher:
    """Picks workers (filter, then the router), forwards requests (worker client), retries.

    A request is for one model, and only its workers are tried; a request in flight at a second
    worker's death is refused rather than sent to a third (`refuse`)."""

    def __init__(self, supervisor: Supervisor, settings: RouterSettings, metrics: RouterMetrics,
                 tracing: Tracing = NO_TRACING, router: Router | None = None, models: ModelManager | None = None):
        self.supervisor = supervisor
        self.settings = settings
        self.metrics = metrics
        self.tracing = tracing  # notes route decisions and retries on the request's span
        self.router = router or Router(settings.routing)  # scores and picks among the workers that pass
        self.quarantine = Quarantine()  # requests refused for killing workers (server/dispatch/faults.py)
        self.models = models  # loads a model no worker serves (on demand)
        self.disagg = None  # prefill/decode roles and the handoff (server/dispatch/handoff.py), set by the app

    # --- choosing ----------------------------------------------------------------------
    async def _acquire(self, c: Constraints, req: RouteRequest, exclude: dict[str, int], deadline: float,
                       saw_429: bool) -> tuple[WorkerHandle, Ticket, str]:
        """The worker for one attempt, its ticket (one more request in flight there) and why, or a
        `DispatchError`: the filter says who may take it, then the router picks among them."""
        s = self.settings
        while True:
            f = eligible(self.supervisor.workers.values(), c, s.worker_capacity, exclude)
            if f.kind == ELIGIBLE:
                worker, route = self.router.pick(list(f.workers), c, req)
                ticket = self.router.begin(worker, route, req)
                worker.breaker.on_dispatch()
                return worker, ticket, f"{route.header}: {route.detail} ({f.reason})"
            left = deadline - time.monotonic()
            if f.kind == UNLOADED:
                assert c.model is not None
                try:
                    under_way = self.models.request_load(c.model) if self.models is not None else f.reason
                except ModelUnavailable as e:
                    raise DispatchError(503, e.message, "unavailable", e.retry_after or s.retry_after_s, c.model) from e
                if left <= 0:
                    raise DispatchError(503, f"{f.reason}: {under_way}; retry later", "unavailable", s.retry_after_s,
                                        c.model)
                await self.supervisor.wait_changed(min(left, 0.5))
                continue
            if f.kind == UNSATISFIABLE:
                raise DispatchError(422, f.reason, "validation", model=c.model)
            if f.kind == OVERLOADED or saw_429:
                full = f.reason if f.kind == OVERLOADED else "every worker queue is full"
                raise DispatchError(429, f"Overloaded: {full}; retry later", "overloaded", s.retry_after_s, c.model)
            if f.kind == WAIT and left > 0:
                await self.supervisor.wait_changed(min(left, 0.5))
                continue
            loading = self.models is not None and c.model is not None and self.models.loading(c.model)
            why = (f"Model `{c.model}` is loading ({f.reason}); retry later" if loading
                   else f"No worker available: {f.reason}")
            raise DispatchError(503, why, "unavailable", s.retry_after_s, c.model)

    def _attempts(self) -> int:
        return 2 * len(self.supervisor.workers) + 2

    def _failed(self, worker: WorkerHandle, generation: int, exclude: dict[str, int], why: str) -> None:
        exclude[worker.id] = generation
        self.metrics.worker_retry(worker)
        note_retry(self.tracing, worker, why)
        logger.warning("request failed on worker %s (%s); retrying elsewhere", worker.id, why)
        self.supervisor.report_unreachable(worker, generation)

    @staticmethod
    def _judge(worker: WorkerHandle, generation: int, result: WorkerReply | WorkerStream) -> None:
        """The breaker's view of an answer: 5xx failure, 429 or the request's own fault no
        verdict, anything else success."""
        status = result.status if isinstance(result, WorkerReply) else 200
        if status == 429 or (status >= 500 and request_fault(status, result.content)):
            worker.request_outcome(generation, None)
        else:
            worker.request_outcome(generation, status < 500, f"answered {status}")

    # --- one loop of attempts for both kinds ---------------------------------------------
    async def _with_retries(self, c: Constraints, req: RouteRequest,
                            attempt: Callable[[WorkerHandle, Ticket], Awaitable[WorkerReply | WorkerStream]],
                            exclude: dict[str, int] | None = None, deaths: Deaths | None = None,
                            key: Callable[[], str] | None = None, wait: bool = True):
        """Runs `attempt` on chosen workers until one gives an answer that is not retried.

        `attempt` returns the worker's reply (retried on 429/503, once on another 5xx) or an open
        stream, and raises `_Lost` when the worker went away before the client got anything; it
        ends the ticket when the reply is in, a refusal read or the attempt failed (a stream: on
        close).
        `exclude` (worker id -> generation that failed this request) and `deaths` (workers that
        died under it) may come from earlier tries (none: the prefill-only workers are left out);
        `key()` is its quarantine fingerprint; `wait` False: no waiting for a worker to be ready."""
        if exclude is None:
            exclude = self.disagg.held_back(self.supervisor.workers.values(), c) if self.disagg is not None else {}
        deaths = Deaths() if deaths is None else deaths
        deadline = time.monotonic() + (self.settings.ready_wait_s if wait else 0.0)
        if self.models is not None and c.model is not None:
            self.models.touch(c.model)
        saw_429 = error_retried = False
        last: WorkerReply | None = None
        for n in range(self._attempts()):
            try:
                worker, ticket, why = await self._acquire(c, req, exclude, deadline, saw_429)
            except DispatchError:
                if last is not None and last.status != 429:
                    return last
                raise
            note_route(self.tracing, worker, why, n + 1)
            generation = worker.generation
            assert worker.client is not None
            self.metrics.worker_request(worker)
            try:
                result = await attempt(worker, ticket)
            except _Lost as e:
                worker.request_outcome(generation, False, e.why)
                self._failed(worker, generation, exclude, e.why)
                if e.died and worker.crashed_under(generation) and deaths.witnessed(worker.id):
                    self.refuse(key, deaths)
                continue
            except BaseException:  # cancelled (the client left): no verdict on the worker
                worker.request_outcome(generation, None)
                raise
            self._judge(worker, generation, result)
            result.headers[HEADER_ROUTE.lower()] = ticket.route.header
            if isinstance(result, WorkerReply):
                last = result
                fault = request_fault(result.status, result.content)
                again, error_retried = _retry(result.status, error_retried, fault)
                if again:
                    saw_429 = saw_429 or result.status == 429
                    self._failed(worker, generation, exclude, f"answered {result.status}")
                    continue
            note_answer(self.tracing, worker)
            return result
        raise DispatchError(503, "No worker could take the request after several tries", "unavailable",
                            self.settings.retry_after_s, c.model)

    def refuse(self, key: Callable[[], str] | None, deaths: Deaths) -> None:
        """Refuse a request that was in flight at `deaths` (a 422), and quarantine it."""
        reason = deaths.reason()
        if key is not None:
            self.quarantine.add(key(), reason)
        logger.warning("refusing a request: %s", reason)
        raise DispatchError(422, reason, REFUSED_TYPE)

    def check_quarantine(self, path: str, body: WireRequest) -> None:
        """A 422 for a request refused earlier for killing workers (nothing to do while none was)."""
        if self.quarantine and (reason := self.quarantine.reason(fingerprint(path, body))) is not None:
            raise DispatchError(422, reason, REFUSED_TYPE)

    # --- non-streamed ------------------------------------------------------------------
    async def generate(self, path: str, body: WireRequest, c: Constraints) -> WorkerReply:
        """The worker's whole answer (any status but 429/503, which are retried elsewhere)."""
        body = with_lora(body, c)
        self.check_quarantine(path, body)

        async def attempt(worker: WorkerHandle, ticket: Ticket) -> WorkerReply:
            try:
                status, headers, content = await worker.client.post(path, body, self.tracing.inject())
            except WorkerGone as e:
                raise _Lost(repr(e), died=not isinstance(e, WorkerDown)) from e
            finally:
                ticket.end()
            return WorkerReply(status, content, worker_headers(worker, headers), worker)

        return await self._with_retries(c, self.router.request(body, c), attempt,
                                        key=lambda: fingerprint(path, body))

    # --- streamed ----------------------------------------------------------------------
    async def open_stream(self, path: str, body: WireRequest, c: Constraints,
                          exclude: dict[str, int] | None = None,
                          deaths: Deaths | None = None, wait: bool = True) -> WorkerStream | WorkerReply:
        """A stream whose first event exists, or the worker's refusal (e.g. 422) as a reply.
        `exclude`: workers (id -> generation) that already failed this request; `deaths`: those
        that died under it; `wait` False: a 503 rather than waiting for a worker to be ready."""
        body = with_lora(body, c)
        self.check_quarantine(path, body)

        async def attempt(worker: WorkerHandle, ticket: Ticket) -> WorkerStream | WorkerReply:
            generation = worker.generation
            stack = contextlib.AsyncExitStack()
            try:
                response = await stack.enter_async_context(worker.client.stream(path, body, self.tracing.inject()))
                headers = worker_headers(worker, response.headers)
                if response.status_code != 200:
                    content = await response.read()
                    await stack.aclose()
                    ticket.end()
                    return WorkerReply(response.status_code, content, headers, worker)
                sse = SSEEvents(response.iter_chunks())
                first = await sse.next_batch()
                if first is None:
                    raise StopAsyncIteration("the stream ended before its first event")
            except (*WorkerGone, StopAsyncIteration) as e:
                await stack.aclose()
                ticket.end()
                raise _Lost(f"no first event: {e!r}", died=not isinstance(e, WorkerDown)) from e
            except BaseException:
                await stack.aclose()
                ticket.end()
                raise
            return WorkerStream(worker, headers, first[0], first[1], sse, stack, generation=generation, ticket=ticket)

        return await self._with_retries(c, self.router.request(body, c), attempt, exclude, deaths,
                                        key=lambda: fingerprint(path, body), wait=wait)


def with_lora(body: WireRequest, c: Constraints) -> WireRequest:
    """`body` with the LoRA adapter the request's model names (server/config/loras.py), once."""
    if c.lora is None or not isinstance(body, WorkerRequest) or body.lora == c.lora:
        return body
    return body.model_copy(update={"lora": c.lora})
