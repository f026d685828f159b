"""Bursts of one-token requests at once: how long the whole burst takes to be answered.

    python benchmarks/burst.py                          # starts `hetserve serve` (the embedded model, bfloat16)
    python benchmarks/burst.py --url http://127.0.0.1:8000 --sizes 1 16 32 --rounds 5

Design: each burst sends `size` `/v1/completions` requests at once (random 128-token prompts,
`max_tokens` 1, greedy, `ignore_eos`), after one request alone to wake the server; it records each
request's latency. Per burst size it prints the median over `--rounds` bursts of the median
request's latency and of the last one's: a server that prefills a burst's prompts in shared steps
answers the last request about when the median one; one that takes them one after another answers
the last one `size` prefills after the first. Without `--url` it serves the checkpoint itself with
`hetserve serve --model DIR --dtype bfloat16` on a free port and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a server already running (default: start hetserve)")
    p.add_argument("--model", type=Path, default=ROOT / "workers" / "default_model")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 32])
    p.add_argument("--tokens", type=int, default=128, help="prompt tokens")
    p.add_argument("--rounds", type=int, default=5)
    return p.parse_args(argv)


async def one(client: httpx.AsyncClient, model: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                   "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return time.perf_counter() - t0


async def burst(url: str, model: str, size: int, tokens: int, seed: int) -> list[float]:
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(10, 4000) for _ in range(tokens)] for _ in range(size)]
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=size + 1)) as c:
        await one(c, model, prompts[0])
        return sorted(await asyncio.gather(*(one(c, model, p) for p in prompts)))


def serve(model: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--dtype", "bfloat16",
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"hetserve serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("hetserve serve was not ready after 600 s")


def main(argv=None) -> int:
    args = parse_args(argv)
    proc, url = (None, args.url) if args.url else serve(args.model)
    try:
        print(f"{url}: bursts of one-token requests, {args.tokens}-token prompts, median of {args.rounds} bursts")
        for size in args.sizes:
            runs = [asyncio.run(burst(url, str(args.model.resolve()), size, args.tokens, seed))
                    for seed in range(args.rounds)]
            med = statistics.median(statistics.median(r) for r in runs)
            last = statistics.median(r[-1] for r in runs)
            print(f"  burst of {size:3d}: median request {med * 1e3:7.1f} ms, last {last * 1e3:7.1f} ms")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
