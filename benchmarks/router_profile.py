"""Where the router's time goes on one request: cProfile of the router process over N requests.

    python benchmarks/router_profile.py [--requests 300] [--path /generate] [--top 40] [--fake]

Starts `hetserve serve` with one worker (the embedded model, or the stand-in worker with
`--fake`) under a wrapper that turns cProfile on and off in the router process on signals,
sends warm-up requests, then profiles `--requests` sequential one-token requests (TGI
`/generate`, or `--path /v1/chat/completions`) and prints:
  - the router's CPU time per request without the profiler (user + system from /proc, read
    around the same number of requests), the number that matters;
  - the profile's own CPU time and function calls per request by component (HTTP server, ASGI
    app, request validation, routing, dispatch, engine channel and text, metrics, asyncio);
  - the profile's per-request CPU time for each stage (the functions below, cumulative; a
    coroutine's cumulative time is its CPU time across its awaits), and the top functions by
    own time. The profiler counts CPU time, not wall time: on shared cores a write that wakes
    the worker or the client may be preempted for milliseconds, which is no cost of the
    router's. cProfile inflates small functions' cost; read its shares, not its absolute figures.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (label, substring of "file:function" in the profile), in the order a request meets them
STAGES = [
    ("HTTP parse (uvicorn's protocol, the edge's limits)", ("http11.py:data_received",)),
    ("app call (middleware .. response sent)", ("middleware.py:__call__",)),
    ("  FastAPI request handling (body, validation, route)", ("fastapi/routing.py:app",)),
    ("  body parse + validation without FastAPI", ("direct.py:_validated",)),
    ("  route: public -> WorkerRequest", (":_worker_request",)),
    ("  dispatcher.generate", ("dispatcher.py:generate",)),
    ("    filter + routing pick", ("dispatcher.py:_acquire",)),
    ("    worker client post (channel)", ("client.py:post",)),
    ("      prompt tokenize", ("text.py:with_prompt_ids",)),
    ("      channel submit (encode, wait admission)", ("channel.py:submit",)),
    ("      events -> text -> answer JSON", ("text.py:answer",)),
    ("  response serialization", ("responses.py:__call__",)),
    ("channel frames in (reader task, or socket protocol)", ("channel.py:_read", "channel.py:data_received")),
    ("metrics observe", ("metrics.py:observe",)),
]


# (component, substrings of a profiled function's file or name), first match wins: own time only
COMPONENTS = [
    ("HTTP server (uvicorn, httptools, the edge's protocol)", ("uvicorn/", "httptools", "edge/http11.py")),
    ("metrics", ("prometheus_client/", "fleet/metrics.py")),
    ("routing (filter, policy, prefix index, speeds)", ("server/routing/", "fleet/handle.py")),
    ("dispatch (retries, breaker, tickets)", ("server/dispatch/", "fleet/breaker.py")),
    ("request translation and validation (pydantic, contract)", ("pydantic", "workers/contract/request.py",
                                                                 "server/protocol/", "routes/_common.py")),
    ("engine channel and text (tokenize, frames, detokenize, JSON)", (
        "fleet/channel.py", "fleet/client.py", "fleet/text.py", "workers/contract/", "tokenizers", "msgspec",
        "json/")),
    ("ASGI app (FastAPI, Starlette, middleware, routes)", ("fastapi/", "starlette/", "server/edge/", "email/")),
    ("asyncio (tasks, futures, queues, streams)", ("asyncio/", "_weakrefset", "contextlib")),
    ("built-ins called from all of the above (len, dict.get, isinstance, ...)", ("~:",)),
]


def component_table(stats: pstats.Stats, n: int) -> list[tuple[str, float, float]]:
    """(component, own CPU ms per request, function calls per request), the rest last."""
    sums = {name: [0.0, 0.0] for name, _ in COMPONENTS} | {"everything else": [0.0, 0.0]}
    for (file, _, func), (_, nc, tt, _, _) in stats.stats.items():
        where = f"{file}:{func}"
        name = next((c for c, needles in COMPONENTS if any(x in where for x in needles)), "everything else")
        sums[name][0] += tt
        sums[name][1] += nc
    return [(name, tt * 1e3 / n, nc / n) for name, (tt, nc) in sums.items()]


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def serve_profiled(out: str, argv: list[str]) -> int:
    """The child: `hetserve serve argv`, cProfile on at SIGUSR1, off and dumped to `out` at SIGUSR2."""
    from server.cli import main

    prof = cProfile.Profile(time.process_time)  # CPU time: a preemption in a syscall is not our cost
    signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
    signal.signal(signal.SIGUSR2, lambda *_: (prof.disable(), prof.dump_stats(out)))
    return main(argv)


def body_for(path: str) -> dict:
    if path == "/v1/chat/completions":
        return {"model": "default", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}
    if path == "/v1/completions":
        return {"model": "default", "prompt": "Hello", "max_tokens": 1}
    return {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}


def run_requests(client: httpx.Client, path: str, n: int) -> list[float]:
    body, times = body_for(path), []
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post(path, json=body)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    return times


def stage_table(stats: pstats.Stats, n: int) -> list[tuple[str, float, float]]:
    """(label, cumulative ms per request, calls per request) for each stage found."""
    rows = []
    for label, needles in STAGES:
        cum = calls = 0.0
        for (file, _, func), (_, nc, _, ct, _) in stats.stats.items():
            if any(needle in f"{file}:{func}" for needle in needles):
                cum, calls = cum + ct, calls + nc
        rows.append((label, cum * 1e3 / n, calls / n))
    return rows


def _print_unprofiled(args, user_ms: float, sys_ms: float, times: list[float]) -> int:
    print(f"{args.requests} sequential one-token {args.path} ({'fake' if args.fake else 'real'} worker), "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"  unprofiled: router CPU {user_ms + sys_ms:.2f} ms per request (user {user_ms:.2f}, system "
          f"{sys_ms:.2f}), wall p50 {times[len(times) // 2] * 1e3:.2f} ms")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--path", default="/generate")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--fake", action="store_true")
    p.add_argument("--no-profile", action="store_true", help="only the CPU time and wall time, no cProfile run")
    p.add_argument("--serve-profiled", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_profiled is not None:
        return serve_profiled(args.serve_profiled[0], args.serve_profiled[1:])

    from benchmarks.router_overhead import default_model
    from tests.router_harness import FAKE_WORKER, RouterProcess, free_port

    out = tempfile.mktemp(prefix="hetserve-router-", suffix=".prof")
    port = free_port()
    serve = ["serve", "--host", "127.0.0.1", "--port", str(port), "--simulate", "sm_90"]
    env = dict(os.environ)
    if args.fake:
        env["HETSERVE_WORKER_CMD"] = f"{sys.executable} {FAKE_WORKER}"
    else:
        serve += ["--model", default_model()]
    log = tempfile.NamedTemporaryFile(prefix="hetserve-router-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, __file__, "--serve-profiled", out, *serve], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    router = RouterProcess.__new__(RouterProcess)  # the harness's readiness wait and stop, on this process
    router.port, router.url, router.proc, router.log = port, f"http://127.0.0.1:{port}", proc, log
    router.worker_pids = []
    try:
        router._wait_ready(300, None)
        with httpx.Client(base_url=router.url, timeout=60) as client:
            run_requests(client, args.path, 50)  # warm-up
            (u0, s0) = cpu_seconds(proc.pid)
            times = sorted(run_requests(client, args.path, args.requests))
            (u1, s1) = cpu_seconds(proc.pid)
            user_ms, sys_ms = (u1 - u0) * 1e3 / args.requests, (s1 - s0) * 1e3 / args.requests
            if args.no_profile:
                return _print_unprofiled(args, user_ms, sys_ms, times)
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.2)
            run_requests(client, args.path, args.requests)
            os.kill(proc.pid, signal.SIGUSR2)
            time.sleep(1.0)
    finally:
        router.stop()
    _print_unprofiled(args, user_ms, sys_ms, times)
    stats = pstats.Stats(out)
    calls = sum(nc for (_, nc, _, _, _) in stats.stats.values()) / args.requests
    print(f"  profiled: {stats.total_tt * 1e3 / args.requests:.2f} ms CPU and {calls:.0f} Python function calls "
          "per request in the profiler")
    for label, ms, calls in stage_table(stats, args.requests):
        print(f"    {label:56} {ms:7.3f} ms  ({calls:.1f} calls)")
    print("  own time by component (profiled CPU ms per request, share, function calls per request):")
    for name, ms, calls in component_table(stats, args.requests):
        print(f"    {name:62} {ms:6.3f} ms {100 * ms * args.requests / stats.total_tt / 1e3:5.1f}% {calls:6.0f}")
    stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
