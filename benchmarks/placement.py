"""Several models on one router: what routing by model adds, and how long a model loaded on demand takes.

    python benchmarks/placement.py [--requests 400] [--swaps 3] [--json]
    python benchmarks/placement.py --fake      # stand-in workers: the router's cost alone

Three measurements, each side by side in one run (the machine is shared and noisy):
  0. in process, without HTTP: the router's choice for one request (the filter, which keeps
     only the model's workers, then the pick: `Dispatcher._acquire` without the dispatch) over
     one model's three workers against three models' workers (the same three for model `a`, six
     of `b` and `c` beside them), alternating in blocks; what a request for one of several models
     costs the router before any I/O;
  1. the router's added latency with three models served against one: a router serving model
     `a` alone (`--simulate sm_90`) and one serving `a`, `b` and `c` (`--simulate
     sm_80,sm_89,sm_90`, placement puts each on its own device), both asked for `a` by one-token
     `/generate` with `X-Hetserve-Model: a`, each beside the same request straight to `a`'s
     worker socket; the four calls of an iteration alternate their order. Added latency is
     router minus direct; the figure to watch is the three-model router's added p50 minus the
     one-model router's (target: at most 0.1 ms);
  2. time to first token of a model that is not loaded: one device, `--max-loaded-models 1`,
     `--model-min-residence-s 0`, models `a` and `b`; each swap streams one `/v1/completions` request (OpenAI `model`
     field) for the model not loaded, which the router holds while it unloads the other and
     starts a worker for this one; then the same request warm. Shown: cold and warm time to
     first token, and the router's own load time of that model (`/workers` `models[].last_load_s`,
     from the load's start to a ready worker) beside them.
Without `--fake` the workers are real, serving the embedded model (else a tiny random
checkpoint, tests/checkpoints.py) under every name: the same bytes, so only routing differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.router_overhead import default_model, percentile, worker_socket  # noqa: E402
from tests.router_harness import RouterProcess  # noqa: E402

NAMES = ("a", "b", "c")


def model_dirs(fake: bool, model: str | None) -> dict[str, str]:
    """One directory per model name: copies of the embedded config for stand-in workers, else one
    real checkpoint that every name serves."""
    if not fake:
        path = model or default_model()
        return {n: path for n in NAMES}
    from workers.contract import DEFAULT_MODEL_DIR

    root = Path(tempfile.mkdtemp(prefix="hetserve-placement-"))
    for n in NAMES:
        (root / n).mkdir()
        shutil.copy(DEFAULT_MODEL_DIR / "config.json", root / n / "config.json")
    return {n: str(root / n) for n in NAMES}


def socket_of(router: RouterProcess, model: str) -> str:
    """The Unix socket of the (first) worker serving `model`."""
    worker = next(w for w in router.workers() if w["model"]["name"] == model)
    return worker_socket(worker["pid"])


def choice_cost(rounds: int, per_round: int) -> dict:
    """Section 0 of the module docstring: microseconds per choice, one model against three."""
    from server.config.routing import RoutingConfig
    from server.config.settings import RouterSettings
    from server.fleet.handle import WorkerHandle
    from server.fleet.spec import build_worker_specs
    from server.routing.filter import ELIGIBLE, Constraints, eligible
    from server.routing.router import Router
    from workers.contract import CapabilityPayload, WorkerState, parse_simulate

    settings = RouterSettings(worker_command=("python", "-m", "workers"))

    def handles(spec: str, models: dict[int, tuple[str, Path]]) -> list:
        out = []
        for s in build_worker_specs(parse_simulate(spec), settings, Path("/tmp/run"), 42, {}, models):
            h = WorkerHandle(s, state=WorkerState.READY, generation=1)
            h.client = object()  # routable; nothing is sent
            h.info = CapabilityPayload(fp8={"convention": "emulated", "reason": "bench"},
                                       capacity={"max_seq_len": 512, "kv_block_size": 16, "kv_blocks_total": 64})
            out.append(h)
        return out

    spec9 = ",".join(["sm_80", "sm_89", "sm_90"] * 3)
    one = handles("sm_80,sm_89,sm_90", {i: ("a", Path("/m/a")) for i in range(3)})
    three = handles(spec9, {i: ("abc"[i // 3], Path(f"/m/{'abc'[i // 3]}")) for i in range(9)})
    c = Constraints(model="a")
    sides = {"one_model": (one, Router(RoutingConfig())), "three_models": (three, Router(RoutingConfig()))}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(rounds + 2):
        for name in (list(sides) if r % 2 else list(sides)[::-1]):
            workers, router = sides[name]
            req = router.request({"inputs": "Hello there, how are you today?"}, c)
            t0 = time.perf_counter()
            for _ in range(per_round):
                f = eligible(workers, c, settings.worker_capacity)
                assert f.kind == ELIGIBLE and len(f.workers) == 3, (name, f)
                router.pick(list(f.workers), c, req)
            if r >= 2:  # warm-up
                times[name].append((time.perf_counter() - t0) / per_round * 1e6)
    out = {k: {"median_us": statistics.median(v), "min_us": min(v)} for k, v in times.items()}
    out["three_minus_one_us"] = out["three_models"]["median_us"] - out["one_model"]["median_us"]
    return out


async def added_latency(one: RouterProcess, three: RouterProcess, n: int) -> dict:
    """Section 1 of the module docstring."""
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}
    headers = {"X-Hetserve-Model": "a"}
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)

    def unix(path: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url="http://worker", timeout=60,
                                 transport=httpx.AsyncHTTPTransport(uds=path, limits=limits))

    clients = {
        "one_router": httpx.AsyncClient(base_url=one.url, timeout=60, limits=limits, headers=headers),
        "one_direct": unix(socket_of(one, "a")),
        "three_router": httpx.AsyncClient(base_url=three.url, timeout=60, limits=limits, headers=headers),
        "three_direct": unix(socket_of(three, "a")),
    }
    times: dict[str, list[float]] = {k: [] for k in clients}
    order = list(clients)
    try:
        for i in range(n + 20):
            for name in order[i % 4:] + order[:i % 4]:  # rotate, so drift hits every side alike
                t0 = time.perf_counter()
                r = await clients[name].post("/generate", json=body)
                dt = time.perf_counter() - t0
                assert r.status_code == 200, (name, r.status_code, r.text)
                if name.endswith("router"):
                    assert r.headers["x-hetserve-model"] == "a", r.headers
                if i >= 20:  # warm-up
                    times[name].append(dt * 1e3)
    finally:
        for c in clients.values():
            await c.aclose()
    out = {k: {"p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99), "mean_ms": statistics.fmean(v)}
           for k, v in times.items()}
    for side in ("one", "three"):
        out[f"{side}_added"] = {k: out[f"{side}_router"][k] - out[f"{side}_direct"][k]
                                for k in ("p50_ms", "p99_ms", "mean_ms")}
    out["three_minus_one"] = {"added_p50_ms": out["three_added"]["p50_ms"] - out["one_added"]["p50_ms"]}
    return out


async def first_token(client: httpx.AsyncClient, model: str) -> tuple[float, str]:
    """Seconds from sending a streamed completion for `model` to its first text, and that text."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"`{model}`: HTTP {r.status_code} {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                text = json.loads(line[5:])["choices"][0].get("text", "")
                if text:
                    return time.perf_counter() - t0, text
    raise RuntimeError(f"`{model}`: the stream ended without text")


async def on_demand(router: RouterProcess, swaps: int, warm: int) -> dict:
    """Section 2 of the module docstring."""
    cold, hot, loads = [], [], []
    async with httpx.AsyncClient(base_url=router.url, timeout=300) as client:
        for i in range(swaps):
            model = "ab"[(i + 1) % 2]  # `a` is loaded at start: b, a, b, ...
            seconds, _ = await first_token(client, model)
            cold.append(seconds)
            status = (await client.get("/workers")).json()
            loaded = {m["name"]: m for m in status["models"]}
            assert loaded[model]["state"] == "loaded" and loaded["ab".replace(model, "")]["state"] == "unloaded"
            loads.append(loaded[model]["last_load_s"])
            for _ in range(warm):
                hot.append((await first_token(client, model))[0])
    return {"cold_first_token_s": cold, "router_load_s": loads, "warm_first_token_ms": [h * 1e3 for h in hot],
            "cold_p50_s": statistics.median(cold), "load_p50_s": statistics.median(loads),
            "warm_p50_ms": statistics.median(hot) * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint every name serves (real workers)")
    p.add_argument("--fake", action="store_true", help="stand-in workers (tests/router_fake_worker.py)")
    p.add_argument("--requests", type=int, default=400, help="one-token requests per side")
    p.add_argument("--swaps", type=int, default=3, help="loads on demand to time")
    p.add_argument("--warm", type=int, default=5, help="warm requests after each load")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    choice = choice_cost(40, 2000)
    dirs = model_dirs(args.fake, args.model)
    kw = {"fake": args.fake, "ready_timeout": 300, "env": {"FAKE_TOKEN_S": "0.002"} if args.fake else None}
    models = [x for n in NAMES for x in ("--model", f"{n}={dirs[n]}")]
    routers: list[RouterProcess] = []
    try:
        routers.append(RouterProcess(["--simulate", "sm_90", "--model", f"a={dirs['a']}"], **kw))
        routers.append(RouterProcess(["--simulate", "sm_80,sm_89,sm_90", *models], **kw))
        one, three = routers
        assert sorted(w["model"]["name"] for w in three.workers()) == list(NAMES), three.workers()
        latency = asyncio.run(added_latency(one, three, args.requests))
        for r in routers:
            r.stop()
        routers = [RouterProcess(["--simulate", "sm_90", *models[:4], "--max-loaded-models", "1",
                                  "--model-min-residence-s", "0"], **kw)]  # every swap a load, as measured
        loading = asyncio.run(on_demand(routers[0], args.swaps, args.warm))
    finally:
        for r in routers:
            r.stop()
    result = {"choice": choice, "added_latency": latency, "on_demand": loading,
              "setup": {"worker": "fake" if args.fake else "real", "requests": args.requests, "swaps": args.swaps}}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print("the router's choice for a request for model a (filter + pick, in process)")
    for side in ("one_model", "three_models"):
        print(f"  {side:14} {choice[side]['median_us']:8.2f} us  (min {choice[side]['min_us']:.2f})")
    print(f"  three models - one: {choice['three_minus_one_us']:+.2f} us")
    print(f"one-token /generate for model a, {args.requests} requests per side ({result['setup']['worker']} workers)")
    print(f"  {'':14} {'p50 ms':>8} {'p99 ms':>8}")
    for side in ("one", "three"):
        for part in ("direct", "router", "added"):
            row = latency[f"{side}_{part}"]
            print(f"  {side + ' ' + part:14} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f}")
    d = latency["three_minus_one"]
    print(f"  three models - one: added p50 {d['added_p50_ms']:+.3f} ms   (target: at most +0.1 ms)")
    print(f"first token of a model not loaded (one device, --max-loaded-models 1), {args.swaps} swaps")
    print(f"  cold  {loading['cold_p50_s']:8.2f} s  "
          f"(each: {', '.join(f'{s:.2f}' for s in loading['cold_first_token_s'])})")
    print(f"  load  {loading['load_p50_s']:8.2f} s  (the router's load: unload the other, start, ready)")
    print(f"  warm  {loading['warm_p50_ms']:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
