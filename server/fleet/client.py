"""HTTP to one worker over its Unix socket (server/fleet/uds_http.py, one keep-alive pool per worker).

A request goes out as one of the contract's typed bodies (`WorkerRequest` and the others of
workers/contract/wire.py, nothing else), and the worker answers in TGI's shapes, so streamed
bytes are relayed untouched. Generations go on the worker's engine channel instead when it has
one (server/fleet/channel.py: typed frames on one connection; on a channel of token ids the
router tokenizes the prompt and builds those bytes itself: server/fleet/text.py). A worker that
dies shows up here as one of `WorkerGone` (nothing listens, or the connection broke
mid-answer); the dispatcher turns that into a retry or a migration. Generation reads have no
timeout (a long generation is not a failure); a hung worker is caught by the supervisor's
health checks instead, which then `abort()` its connections so that every read blocked on it
fails at once. Control calls (health, capability, metrics) time out after a few seconds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from server.fleet.channel import GENERATE_PATH, STREAM_PATH, ChannelRefused, ChannelStream, WorkerChannel
from server.fleet.text import StreamText, TextModel, with_prompt_ids
from server.fleet.uds_http import Response, UnixHTTPPool, WorkerConnectError, WorkerConnectionLost
from workers.contract import CapabilityPayload, WireRequest, WorkerRequest, wire_bytes

_CONTROL_TIMEOUT_S = 5.0

# Errors that mean "the worker is gone or went away mid-answer" (not a bad request).
WorkerGone = (WorkerConnectError, WorkerConnectionLost, TimeoutError)
WorkerDown = WorkerConnectError  # nothing listens on the socket at all


class WorkerHTTPError(Exception):
    """A control call answered with an error status."""


class WorkerClient:
    """Talks to one worker socket. Cheap to keep; `aclose()` when the worker is replaced."""

    def __init__(self, socket_path: Path | str, channel: bool = True):
        self.socket_path = str(socket_path)
        self._pool = UnixHTTPPool(self.socket_path)
        self._use_channel = channel  # streams share one stream channel (server/fleet/channel.py)
        self._channel: WorkerChannel | None = None
        self._opening = asyncio.Lock()

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.aclose()
        await self._pool.aclose()

    def abort(self) -> None:
        """Break every connection to the worker (it hangs): requests under way fail at once."""
        self._pool.abort()
        if self._channel is not None:
            self._channel.close_now()

    # --- control -----------------------------------------------------------------------
    async def _get(self, path: str, timeout: float = _CONTROL_TIMEOUT_S) -> tuple[int, bytes]:
        status, _, content = await asyncio.wait_for(self._pool.request("GET", path), timeout)
        return status, content

    async def health(self, timeout: float = _CONTROL_TIMEOUT_S) -> tuple[int, dict]:
        """(status code, body) of GET /health; raises one of `WorkerGone` when unreachable or
        silent for `timeout` seconds (`TimeoutError`)."""
        status, content = await self._get("/health", timeout)
        return status, _json_or_empty(content)

    async def capability(self) -> CapabilityPayload:
        """The worker's `/capability`, parsed (a `ValueError` when it does not fit the contract)."""
        status, content = await self._get("/capability")
        if status != 200:
            raise WorkerHTTPError(f"/capability answered {status}")
        return CapabilityPayload.model_validate_json(content)

    async def metrics(self) -> str:
        status, content = await self._get("/metrics")
        if status != 200:
            raise WorkerHTTPError(f"/metrics answered {status}")
        return content.decode("utf-8", errors="replace")

    # --- generation --------------------------------------------------------------------
    async def post(self, path: str, body: WireRequest,
                   headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """A non-streamed call: (status, headers, body), the whole answer read. `body`: one of the
        contract's requests (`TypeError` for anything else); `headers`: extra request headers
        (the trace context). A generation goes on the stream channel when its text is built here
        (`/generate` but prompt scoring), so the worker's engine does no text work for it either."""
        if path == GENERATE_PATH and isinstance(body, WorkerRequest) and not body.parameters.scoring_only:
            channel = await self._open_channel()
            if channel is not None and channel.text is not None:
                return await self._generate_on_channel(channel, body, headers)
        return await self._pool.request("POST", path, wire_bytes(body), headers)

    async def _generate_on_channel(self, channel: WorkerChannel, body: WorkerRequest,
                                   headers: dict[str, str] | None) -> tuple[int, dict[str, str], bytes]:
        """`/generate`'s answer, made here from the stream of the same request on `channel`."""
        stream = await self._on_channel(channel, GENERATE_PATH, body, headers)
        try:
            if stream.status_code != 200:
                return stream.status_code, stream.headers, await stream.read()
            events = [event async for batch in stream.event_batches() for event in batch]
            status, content = stream.text.answer(events)
            return status, {**stream.headers, "content-type": "application/json"}, content
        finally:
            await stream.aclose()

    @asynccontextmanager
    async def stream(self, path: str, body: WireRequest,
                     headers: dict[str, str] | None = None) -> AsyncIterator[Response | ChannelStream]:
        """A streamed call; read `iter_chunks()` inside the block. `/generate_stream` goes on the
        worker's stream channel when it has one (opened on first use)."""
        channel = await self._open_channel() if path == STREAM_PATH else None
        if channel is not None:
            response = await self._on_channel(channel, path, body, headers)
        else:
            response = await self._pool.send("POST", path, wire_bytes(body), headers=headers)
        try:
            yield response
        finally:
            await response.aclose()

    async def text_model(self) -> TextModel | None:
        """The tokenizer this worker's streams are rendered with here; None when it renders its own."""
        channel = await self._open_channel()
        return None if channel is None else channel.text

    async def _open_channel(self) -> WorkerChannel | None:
        """The open channel, opened now if needed; None when the worker has none to give (streams
        then go one per connection). Raises one of `WorkerGone` when the worker is unreachable."""
        if not self._use_channel:
            return None
        if self._channel is None or self._channel.dead:
            async with self._opening:
                if self._channel is None or self._channel.dead:
                    try:
                        self._channel = await WorkerChannel.open(self._pool)
                    except ChannelRefused as e:
                        self._use_channel = e.status not in (404, 405)  # a worker without channels: never ask again
                        return None
        return self._channel

    async def _on_channel(self, channel: WorkerChannel, path: str, body: WireRequest,
                          headers: dict[str, str] | None) -> ChannelStream:
        """The stream of `body` on `channel`; on a channel of token ids the prompt goes as ids and
        the stream's text is built here (server/fleet/text.py)."""
        if not isinstance(body, WorkerRequest):
            raise TypeError(f"`{type(body).__name__}` cannot go on the engine channel. Accepted: WorkerRequest")
        text = None
        if channel.text is not None:
            text = StreamText(channel.text, body)
            body = await with_prompt_ids(channel.text, body)
        return await channel.submit(body, headers, generate=path == GENERATE_PATH, text=text)


def _json_or_empty(content: bytes) -> dict:
    try:
        value = json.loads(content)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class SSEEvents:
    """Splits a worker's SSE byte stream into events, keeping the raw bytes for relaying.

    `next_batch()` returns the raw bytes of the next complete events (several may arrive
    in one chunk) plus the last event's `data:` payload, so relays forward bytes untouched
    and look at a payload only where they must (first event, last event).
    """

    def __init__(self, chunks: AsyncIterator[bytes]):
        self._chunks = chunks
        self._buffer = b""

    async def next_batch(self) -> tuple[bytes, str] | None:
        """(raw bytes of >= 1 complete events, the last one's data) or None at the end."""
        async for chunk in self._chunks:
            self._buffer += chunk
            end = self._buffer.rfind(b"\n\n")
            if end < 0:
                continue
            raw, self._buffer = self._buffer[: end + 2], self._buffer[end + 2 :]
            previous = raw.rfind(b"\n\n", 0, end)  # the end of the event before the last one
            return raw, event_data(raw[previous + 2 : end] if previous >= 0 else raw[:end])
        return None

    async def events(self) -> AsyncIterator[str]:
        """Every further event's data payload, one by one."""
        while (batch := await self.next_batch()) is not None:
            for data in split_events(batch[0]):
                yield data


def split_events(raw: bytes) -> list[str]:
    """The data payloads of the complete events in `raw`."""
    return [event_data(block) for block in raw.split(b"\n\n") if block.strip()]


def event_data(block: bytes) -> str:
    """The `data:` payload of one SSE event block (several data lines joined by newlines)."""
    lines = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8", errors="replace")
