"""What carrying a stream across workers costs when nothing fails: the router's relay per event.

    python benchmarks/stream_relay.py [--events 20000] [--rounds 5]

Side by side, alternating rounds, on the same in-memory worker stream (TGI token events as the
worker writes them): (a) the bare SSE splitter the relay reads from (`SSEEvents.next_batch`),
(b) the same through `ClientStream.batches` (server/dispatch/migration.py), which keeps the relayed
bytes for a possible move and checks each batch for a worker error event. Prints microseconds
per event for each and the difference; no process, socket or model is involved, so the
figure is the relay's own CPU cost per streamed token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.dispatch.dispatcher import WorkerStream  # noqa: E402
from server.dispatch.migration import ClientStream  # noqa: E402
from server.fleet.client import SSEEvents  # noqa: E402


def worker_events(n: int) -> list[bytes]:
    """`n` token events, the last one final, as `workers/serving/app.py` streams them."""
    out = []
    for i in range(n):
        last = i == n - 1
        event = {"index": i, "token": {"id": 100 + i, "text": " t", "logprob": -0.5, "special": False},
                 "generated_text": " t" * n if last else None,
                 "details": {"finish_reason": "length", "generated_tokens": n, "input_length": 3, "seed": None}
                 if last else None}
        out.append(f"data: {json.dumps(event)}\n\n".encode())
    return out


async def _chunks(events: list[bytes]):
    for e in events:
        yield e


async def bare(events: list[bytes]) -> int:
    sse, n = SSEEvents(_chunks(events)), 0
    while await sse.next_batch() is not None:
        n += 1
    return n


async def relayed(events: list[bytes]) -> int:
    sse = SSEEvents(_chunks(events))
    first = await sse.next_batch()
    assert first is not None

    class _Worker:
        id = "bench"

    stream = WorkerStream(_Worker(), {}, first[0], first[1], sse, None)  # type: ignore[arg-type]
    client = ClientStream(None, "/generate_stream", {}, None, stream)  # type: ignore[arg-type]
    n = 0
    async for _ in client.batches():
        n += 1
    return n


def per_event_us(fn, events: list[bytes]) -> float:
    t0 = time.perf_counter()
    n = asyncio.run(fn(events))
    assert n == len(events), (fn.__name__, n)
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    events = worker_events(args.events)
    a, b = [], []
    for _ in range(args.rounds):  # alternate, so machine noise hits both
        a.append(per_event_us(bare, events))
        b.append(per_event_us(relayed, events))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"{args.events} events x {args.rounds} rounds, median per event")
    print(f"  (a) bare SSE split          {ma:6.2f} us")
    print(f"  (b) ClientStream.batches    {mb:6.2f} us")
    print(f"  added by the relay: {mb - ma:+.2f} us per event (b/a = {mb / ma:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
