"""Load test of a router on this host: concurrent clients for a bounded time, loopback only.

    python benchmarks/load_test.py                          # starts hetserve serve --simulate sm_80,sm_89,sm_90
    python benchmarks/load_test.py --clients 64 --duration 60 --stream-fraction 0.25
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --router-pid PID   # a running router

Each client loops on its own keep-alive connection, as a real client does: a `/generate`
(or, for a share of clients, a `/generate_stream`) of `--max-new-tokens` tokens, recording
latency and the status. (One shared httpx pool for all clients made requests wait in the
pool, before sending a byte, for up to 6 s: httpx's trace put the 3.6 s p99 there, while the
router and the workers answered every request within 0.5 s.) After `--warmup` seconds at
full load, the router's and the workers' resident memory (VmRSS) are read, the measured
run follows, and memory is read again: growth must stay under 10% (exit code 1 otherwise,
or on any 5xx / connection error). Reported: requests/s, tokens/s, p50/p99 latency and their
ratio (target p99 <= 3x p50), errors by status. The target must be a loopback address: this
tool never loads another host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
RSS_GROWTH_LIMIT = 0.10


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


class Load:
    def __init__(self, url: str, clients: int, max_new_tokens: int, stream_fraction: float):
        self.url, self.clients, self.tokens = url, clients, max_new_tokens
        self.n_stream = round(clients * stream_fraction)
        self.latencies: list[float] = []
        self.statuses: Counter = Counter()
        self.generated = 0
        self.recording = False

    async def _one(self, client: httpx.AsyncClient, stream: bool, i: int) -> None:
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": self.tokens, "seed": i,
                                                             "do_sample": True, "details": True}}
        t0 = time.perf_counter()
        try:
            if stream:
                async with client.stream("POST", "/generate_stream", json=body) as r:
                    events = 0
                    async for raw in r.aiter_raw():
                        events += raw.count(b"data:")
                    status, tokens = r.status_code, events if r.status_code == 200 else 0
            else:
                r = await client.post("/generate", json=body)
                status = r.status_code
                tokens = r.json()["details"]["generated_tokens"] if status == 200 else 0
        except httpx.HTTPError as e:
            status, tokens = f"connection ({type(e).__name__})", 0
        if self.recording:
            self.latencies.append(time.perf_counter() - t0)
            self.statuses[status] += 1
            self.generated += tokens
        if status == 429:
            await asyncio.sleep(0.1)

    async def run(self, seconds: float) -> float:
        deadline = time.perf_counter() + seconds

        async def loop(k: int):
            async with httpx.AsyncClient(base_url=self.url, timeout=300) as client:  # one connection per client
                i = 0
                while time.perf_counter() < deadline:
                    await self._one(client, k < self.n_stream, k * 100_000 + i)
                    i += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop(k) for k in range(self.clients)))
        return time.perf_counter() - t0


def memory(router_pid: int | None, url: str) -> dict[str, int | None]:
    workers = httpx.get(f"{url}/workers", timeout=10).json()["workers"]
    out = {f"worker {w['id']}": rss_bytes(w["pid"]) for w in workers if w.get("pid")}
    if router_pid:
        out = {"router": rss_bytes(router_pid), **out}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running router (loopback only); default: start one")
    p.add_argument("--router-pid", type=int, default=None, help="its pid, for its memory (with --url)")
    p.add_argument("--simulate", default="sm_80,sm_89,sm_90")
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds (bounded)")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--stream-fraction", type=float, default=0.25, help="share of clients that stream")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not 0 < args.duration <= 3600 or not 1 <= args.clients <= 1024:
        p.error("`--duration` must be in (0, 3600] seconds and `--clients` in [1, 1024]")

    router = None
    if args.url is None:
        from tests.router_harness import RouterProcess

        serve = ["--simulate", args.simulate] + (["--model", args.model] if args.model else [])
        router = RouterProcess(serve, fake=False, ready_timeout=300)
        url, router_pid = router.url, router.proc.pid
    else:
        url, router_pid = args.url.rstrip("/"), args.router_pid
        if urlparse(url).hostname not in LOOPBACK:
            p.error(f"`--url {args.url}` is not a loopback address. Accepted hosts: {', '.join(sorted(LOOPBACK))}")
    try:
        load = Load(url, args.clients, args.max_new_tokens, args.stream_fraction)
        asyncio.run(load.run(args.warmup))
        before = memory(router_pid, url)
        load.recording = True
        elapsed = asyncio.run(load.run(args.duration))
        after = memory(router_pid, url)
    finally:
        if router is not None:
            router.stop()
    growth = {k: (after[k] - before[k]) / before[k] for k in before if before[k] and after.get(k)}
    n = sum(load.statuses.values())
    result = {
        "clients": args.clients, "seconds": round(elapsed, 1), "requests": n,
        "requests_per_s": n / elapsed, "tokens_per_s": load.generated / elapsed,
        "latency_p50_s": percentile(load.latencies, 50), "latency_p99_s": percentile(load.latencies, 99),
        "p99_over_p50": percentile(load.latencies, 99) / percentile(load.latencies, 50),
        "statuses": {str(k): v for k, v in sorted(load.statuses.items(), key=str)},
        "rss_before_mib": {k: round(v / 2**20, 1) for k, v in before.items() if v},
        "rss_after_mib": {k: round(v / 2**20, 1) for k, v in after.items() if v},
        "rss_growth": {k: round(v, 4) for k, v in growth.items()},
    }
    bad_status = [k for k in load.statuses if not (isinstance(k, int) and k < 500)]
    ok = not bad_status and all(g < RSS_GROWTH_LIMIT for g in growth.values())
    result["pass"] = ok
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.clients} clients ({load.n_stream} streaming), {args.max_new_tokens} tokens, {elapsed:.0f} s")
        print(f"  {result['requests_per_s']:.1f} req/s, {result['tokens_per_s']:.0f} tokens/s, "
              f"p50 {result['latency_p50_s'] * 1e3:.0f} ms, p99 {result['latency_p99_s'] * 1e3:.0f} ms "
              f"({result['p99_over_p50']:.1f}x; target <= 3x)")
        print(f"  statuses: {result['statuses']}")
        for k in before:
            if before[k] and after.get(k):
                print(f"  RSS {k:12} {before[k] / 2**20:7.1f} -> {after[k] / 2**20:7.1f} MiB ({growth[k] * 100:+.1f}%)")
        print("  PASS" if ok else f"  FAIL (5xx/connection errors: {bad_status}; RSS limit {RSS_GROWTH_LIMIT:.0%})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
