"""The engine channel's messages: one connection per worker, typed, length-prefixed msgpack frames.

Design: the router and its worker exchange every generation over one Unix socket beside the
worker's HTTP socket (`channel_socket_path`). A frame is a 4-byte big-endian length and one
message, a msgspec `Struct` of the tagged union below (encoded and decoded in one C call each).
Router -> worker: `Open` (once, first), `Submit` (a stream's key, the contract's `WorkerRequest`
as the fields its sender set, the trace context), `Abort` (keys whose clients left). Worker ->
router: `Opened` (the channel's id and the worker's identity headers) or `OpenRefused`, then per
submission `Admitted` or `Rejected` (the status and `{"error", "error_type"}` the worker's HTTP
route would have answered, so the router's answer to the client is the same), and per engine step
one `Step` of every stream's records (workers/contract/events.py). Trade-off: the request inside
`Submit` is a map validated again by `WorkerRequest` on arrival (names, limits and defaults stay
declared once, in pydantic) rather than a second msgspec declaration that could drift.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgspec

LENGTH = struct.Struct(">I")  # a frame's length prefix
MAX_FRAME_BYTES = 256 * 1024 * 1024  # a larger length means the stream is not a channel's


class Open(msgspec.Struct, tag="open", frozen=True):
    """The router's first message: `ids` asks for token-id records (the router builds the text)."""

    ids: bool = True


class Submit(msgspec.Struct, tag="submit", frozen=True):
    """One stream: `request` is `WorkerRequest.model_dump(exclude_unset=True)`; `trace` the
    router's trace context headers; `generate` True for a `/generate` answered from the stream."""

    key: int
    request: dict[str, Any]
    trace: dict[str, str] = {}
    generate: bool = False


class Abort(msgspec.Struct, tag="abort", frozen=True):
    keys: list[int]


class Opened(msgspec.Struct, tag="opened", frozen=True):
    channel: str
    ids: bool
    headers: dict[str, str]  # the worker's identity headers (X-Worker-Id, ...), as on an HTTP answer


class OpenRefused(msgspec.Struct, tag="open_refused", frozen=True):
    status: int
    error: str
    error_type: str


class Admitted(msgspec.Struct, tag="admitted", frozen=True):
    key: int


class Rejected(msgspec.Struct, tag="rejected", frozen=True):
    """A refused submission: what `POST /generate_stream` would have answered (`retry_after`
    becomes the `Retry-After` header of a 429)."""

    key: int
    status: int
    error: str
    error_type: str
    retry_after: str | None = None


class Step(msgspec.Struct, tag="step", frozen=True):
    """One engine step's records: (key, the stream's record bytes, whether it is its last)."""

    records: list[tuple[int, bytes, bool]]


ToWorker = Open | Submit | Abort
ToRouter = Opened | OpenRefused | Admitted | Rejected | Step

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_to_router = msgspec.msgpack.Decoder(ToRouter)


def frame(message: ToWorker | ToRouter) -> bytes:
    """One message as a frame: length prefix and msgpack."""
    body = _encoder.encode(message)
    return LENGTH.pack(len(body)) + body


def frame_length(head: bytes) -> int:
    """The length a frame's 4-byte prefix announces; `ValueError` beyond `MAX_FRAME_BYTES`."""
    (n,) = LENGTH.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"a channel frame of `{n}` bytes; at most {MAX_FRAME_BYTES} are accepted")
    return n


def to_worker(body: bytes) -> ToWorker:
    """A router message; `ValueError` for bytes that are not one."""
    try:
        return _to_worker.decode(body)
    except msgspec.DecodeError as e:  # ValidationError is one
        raise ValueError(f"not an engine channel message: {e}") from None


def to_router(body: bytes) -> ToRouter:
    """A worker message; `ValueError` for bytes that are not one."""
    try:
        return _to_router.decode(body)
    except msgspec.DecodeError as e:
        raise ValueError(f"not an engine channel message: {e}") from None


def channel_socket_path(http_socket: str | Path) -> str:
    """The engine channel's socket beside a worker's HTTP socket (`w0.sock` -> `w0.chan`): the
    same length, so a path that fits a Unix socket's limit still fits."""
    p = Path(http_socket)
    return str(p.with_suffix(".chan") if p.suffix == ".sock" else p.with_name(p.name + ".chan"))
