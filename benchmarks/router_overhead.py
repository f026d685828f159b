"""What the router adds: the same requests through the router and straight to the worker, side by side.

    python benchmarks/router_overhead.py [--model DIR] [--simulate sm_90] [--requests 400] [--streams 32]
    python benchmarks/router_overhead.py --fake      # stand-in worker: the router's cost alone

Starts `hetserve serve` with one worker, finds that worker's Unix socket (from its command
line) and then measures, alternating router and direct calls so machine noise hits both:
  1. latency of a one-token `/generate` (sequential): p50 / p99 and the difference
     (added latency; target p50 <= 2 ms), and the CPU time the router's and the worker's
     processes spend per request on each side (user + system, read around each call), which
     stays meaningful when other jobs make wall times noisy: through the router the worker is
     reached on its engine channel, directly on its HTTP socket;
  2. throughput with 32 concurrent `/generate_stream` clients, each streaming `--tokens`
     tokens, for `--seconds` per side, in alternating rounds (target >= 0.9x direct).
Both sides use the same client library (httpx, asyncio): TCP to the router, the Unix
socket to the worker. Without `--model`: the embedded model when present, else a tiny
random checkpoint (tests/checkpoints.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.router_harness import RouterProcess  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def default_model() -> str:
    from workers.contract import DEFAULT_MODEL_DIR

    if (DEFAULT_MODEL_DIR / "config.json").is_file():
        return str(DEFAULT_MODEL_DIR)
    from tests.checkpoints import make_checkpoint

    return str(make_checkpoint(Path(tempfile.mkdtemp(prefix="hetserve-bench-")) / "tiny"))


def worker_socket(pid: int) -> str:
    """The socket of the worker `pid`, from the configuration file its command line names."""
    from workers.contract import WorkerConfig

    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return WorkerConfig.read(argv[argv.index(b"--config") + 1].decode()).socket


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def latency(router: httpx.AsyncClient, direct: httpx.AsyncClient, n: int, pids: dict[str, int]) -> dict:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}
    times: dict[str, list[float]] = {"router": [], "direct": []}
    cpu = {side: dict.fromkeys(pids, 0.0) for side in times}  # side -> process -> seconds
    for i in range(n + 20):
        order = (("router", router), ("direct", direct)) if i % 2 else (("direct", direct), ("router", router))
        for name, client in order:
            before = {proc: cpu_seconds(pid) for proc, pid in pids.items()}
            t0 = time.perf_counter()
            r = await client.post("/generate", json=body)
            dt = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            if i >= 20:  # warm-up
                times[name].append(dt * 1e3)
                for proc, pid in pids.items():
                    cpu[name][proc] += cpu_seconds(pid) - before[proc]
    out = {name: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "mean_ms": statistics.fmean(v),
                  **{f"{proc}_cpu_ms": cpu[name][proc] * 1e3 / n for proc in pids}}
           for name, v in times.items()}
    out["added"] = {k: out["router"][k] - out["direct"][k] for k in out["router"]}
    return out


async def stream_round(client: httpx.AsyncClient, streams: int, tokens: int, seconds: float) -> tuple[int, int, int]:
    """(requests completed, tokens received, errors) by `streams` clients looping for `seconds`."""
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": tokens, "do_sample": True, "seed": 1}}
    deadline = time.perf_counter() + seconds
    done = [0, 0, 0]

    async def one_client():
        while time.perf_counter() < deadline:
            got = 0
            async with client.stream("POST", "/generate_stream", json=body) as r:
                if r.status_code != 200:
                    done[2] += 1
                    await r.aread()
                    continue
                async for raw in r.aiter_raw():  # light on the client: count events, parse nothing
                    got += raw.count(b"data:")
            done[0] += 1
            done[1] += got

    await asyncio.gather(*(one_client() for _ in range(streams)))
    return done[0], done[1], done[2]


async def throughput(router, direct, streams: int, tokens: int, seconds: float, rounds: int) -> dict:
    totals = {"router": [0, 0, 0, 0.0], "direct": [0, 0, 0, 0.0]}
    await stream_round(direct, streams, tokens, 1.0)  # warm-up
    await stream_round(router, streams, tokens, 1.0)
    for i in range(rounds):
        order = (("router", router), ("direct", direct)) if i % 2 else (("direct", direct), ("router", router))
        for name, client in order:
            t0 = time.perf_counter()
            reqs, toks, errs = await stream_round(client, streams, tokens, seconds)
            t = totals[name]
            t[0], t[1], t[2], t[3] = t[0] + reqs, t[1] + toks, t[2] + errs, t[3] + time.perf_counter() - t0
    out = {name: {"requests_per_s": t[0] / t[3], "tokens_per_s": t[1] / t[3], "errors": t[2]}
           for name, t in totals.items()}
    out["ratio_tokens"] = out["router"]["tokens_per_s"] / out["direct"]["tokens_per_s"]
    return out


async def measure(url: str, socket_path: str, args, pids: dict[str, int]) -> dict:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as router, \
            httpx.AsyncClient(base_url="http://worker", timeout=120,
                              transport=httpx.AsyncHTTPTransport(uds=socket_path, limits=limits)) as direct:
        lat = await latency(router, direct, args.requests, pids)
        thr = await throughput(router, direct, args.streams, args.tokens, args.seconds, args.rounds)
    return {"latency_one_token": lat, "throughput_streams": thr}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--simulate", default="sm_90")
    p.add_argument("--fake", action="store_true", help="stand-in worker (tests/router_fake_worker.py)")
    p.add_argument("--requests", type=int, default=400, help="one-token requests per side")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32, help="tokens per streamed request")
    p.add_argument("--seconds", type=float, default=4.0, help="per throughput round and side")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    serve_args = ["--simulate", args.simulate, "--max-batch", str(max(32, args.streams))]
    if not args.fake:
        serve_args += ["--model", args.model or default_model()]
    env = {"FAKE_TOKEN_S": "0.002"} if args.fake else None
    router = RouterProcess(serve_args, env=env, fake=args.fake, ready_timeout=300)
    try:
        (worker,) = router.workers()
        pids = {"router": router.proc.pid, "worker": worker["pid"]}
        result = asyncio.run(measure(router.url, worker_socket(worker["pid"]), args, pids))
    finally:
        router.stop()
    result["setup"] = {"worker": "fake" if args.fake else "real", "simulate": args.simulate,
                       "requests": args.requests, "streams": args.streams, "tokens": args.tokens}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    lat, thr = result["latency_one_token"], result["throughput_streams"]
    print(f"one-token /generate, {args.requests} sequential requests per side ({result['setup']['worker']} worker)")
    print(f"  {'':8} {'p50 ms':>8} {'p99 ms':>8} {'router CPU ms':>14} {'worker CPU ms':>14}")
    for name in ("direct", "router", "added"):
        row = lat[name]
        print(f"  {name:8} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['router_cpu_ms']:14.2f} "
              f"{row['worker_cpu_ms']:14.2f}")
    print(f"{args.streams} concurrent /generate_stream clients, {args.tokens} tokens each")
    for name in ("direct", "router"):
        t = thr[name]
        print(f"  {name:8} {t['tokens_per_s']:9.0f} tok/s {t['requests_per_s']:7.1f} req/s  errors {t['errors']}")
    print(f"  router / direct: {thr['ratio_tokens']:.3f}x   (targets: added p50 <= 2 ms, ratio >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
