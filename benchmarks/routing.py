"""Routing across unequal workers: `cache-aware` against `least-loaded`, side by side in one run.

    python benchmarks/routing.py                     # both routers, the three workloads, the targets
    python benchmarks/routing.py --slowdown gpu0=6,gpu1=3 --kv-cache-bytes 16777216 --seed 1

Two routers run at once, each over three simulated workers (sm_80, sm_89, sm_90) of the
embedded model made unequal with `HETSERVE_SLOWDOWN` (by default the sm_80 worker's forward
passes take 3x as long and the sm_89 worker's 1.5x) and given a KV cache of 11 MiB each
(5632 tokens: a few conversations' worth, as on a busy GPU); one routes `--routing
cache-aware`, the other `--routing least-loaded`. Each warms up (a few requests pinned to
every worker, so that speeds are measured), then each workload runs on one router and then
on the other (alternating which goes first), with the same seeded texts:

(a) chat: 24 conversations of 4 turns, all at once, each turn (`/v1/chat/completions`, after
    the user's pause of up to 2.5 s) resending the whole history; the prefix cache hit rate
    from the workers' own counters (`hetserve_worker_prefix_cache_hits_tokens_total` /
    `..._queries_tokens_total`) and the total time answering (the turns' latencies summed:
    what the users waited; the wall clock, pauses included, is printed beside it). Targets:
    hit rate >= 2x, time >= 1.3x faster.
(b) shared system prompt: 64 independent requests (16 at a time) behind one long system
    prompt. Target: no worker serves more than 60% of them.
(c) unequal workers, no shared prefixes: 72 requests (6 at a time) of distinct prompts.
    Targets: p99 latency no worse than least-loaded (within 5% noise), and the fastest
    worker (least slowed down) serves the most, the slowest the least.

Exit code 1 when a target is missed. About three minutes on two shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from router_harness import RouterProcess  # noqa: E402

from workers.contract.slowdown import slowdown_factor  # noqa: E402

WORDS = (ROOT / "workers" / "default_model" / "corpus_words.txt").read_text().split()
POLICIES = ("cache-aware", "least-loaded")
HITS, QUERIES = "hetserve_worker_prefix_cache_hits_tokens_total", "hetserve_worker_prefix_cache_queries_tokens_total"
P99_NOISE = 1.05
THINK_S = 2.5  # a user's pause before each turn: uniform in [0, THINK_S] seconds
ANSWER_TOKENS = 8  # each chat turn's max_tokens
DOC_WORDS = 90  # each conversation's document, in its system message
ASK_WORDS = 8  # each user turn
KV_CACHE_BYTES = 11 << 20  # each worker's KV cache: a few conversations' worth, as on a busy GPU


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def worker_sums(text: str, name: str) -> dict[str, float]:
    """Per worker id, the samples named `name` in the router's `/metrics`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get("worker_id", "all") != "all":
                out[s.labels["worker_id"]] = out.get(s.labels["worker_id"], 0.0) + s.value
    return out


class Bench:
    """One router under test and what its workloads measured."""

    def __init__(self, policy: str, router: RouterProcess):
        self.policy, self.router = policy, router
        self.client = httpx.AsyncClient(base_url=router.url, timeout=300,
                                        limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))

    async def counters(self) -> tuple[float, float]:
        text = (await self.client.get("/metrics")).text
        return sum(worker_sums(text, HITS).values()), sum(worker_sums(text, QUERIES).values())

    async def reasons(self) -> Counter:
        """Routing decisions so far, by reason."""
        out: Counter = Counter()
        for family in text_string_to_metric_families((await self.client.get("/metrics")).text):
            for s in family.samples:
                if s.name == "hetserve_router_route_decisions_total":
                    out[s.labels["reason"]] += int(s.value)
        return out

    async def chat(self, messages: list[dict], max_tokens: int) -> tuple[str, str, float]:
        t0 = time.perf_counter()
        r = await self.client.post("/v1/chat/completions", json={"model": "m", "messages": messages,
                                                                  "max_tokens": max_tokens, "temperature": 0})
        if r.status_code != 200:
            raise RuntimeError(f"{self.policy}: {r.status_code} {r.text[:300]}")
        return r.json()["choices"][0]["message"]["content"], r.headers["x-worker-id"], time.perf_counter() - t0

    async def warmup(self, rng: random.Random) -> None:
        """Requests pinned to each worker, then two sampling intervals: speeds get measured."""
        for wid in ("gpu0", "gpu1", "gpu2"):
            for n in range(4):
                r = await self.client.post("/generate", headers={"X-Hetserve-Worker": wid},
                                           json={"inputs": words(rng, 60 + 20 * n),
                                                 "parameters": {"max_new_tokens": 24}})
                r.raise_for_status()
        await asyncio.sleep(4.5)

    # --- the workloads ---------------------------------------------------------------------
    async def conversations(self, rng: random.Random, n: int = 24, turns: int = 4) -> dict:
        docs = [words(rng, DOC_WORDS) for _ in range(n)]
        asks = [[words(rng, ASK_WORDS) for _ in range(turns)] for _ in range(n)]
        pauses = [[rng.uniform(0.0, THINK_S) for _ in range(turns)] for _ in range(n)]
        latencies: list[float] = []
        hits0, queries0 = await self.counters()

        async def converse(k: int) -> None:
            messages = [{"role": "system", "content": f"Document {k}: {docs[k]}"}]
            for t in range(turns):
                await asyncio.sleep(pauses[k][t])  # the user reads and types
                messages.append({"role": "user", "content": asks[k][t]})
                answer, _, seconds = await self.chat(messages, ANSWER_TOKENS)
                latencies.append(seconds)
                messages.append({"role": "assistant", "content": answer})

        t0 = time.perf_counter()
        await asyncio.gather(*(converse(k) for k in range(n)))
        seconds = time.perf_counter() - t0
        hits1, queries1 = await self.counters()
        return {"seconds": seconds, "answering": sum(latencies), "p50": percentile(latencies, 50),
                "hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0)}

    async def shared_system_prompt(self, rng: random.Random, n: int = 64, at_once: int = 16) -> dict:
        system = words(rng, 120)
        questions = [words(rng, 12) for _ in range(n)]
        gate = asyncio.Semaphore(at_once)
        served: Counter = Counter()

        async def one(q: str) -> None:
            async with gate:
                _, wid, _ = await self.chat([{"role": "system", "content": system}, {"role": "user", "content": q}], 16)
                served[wid] += 1

        await asyncio.gather(*(one(q) for q in questions))
        return {"shares": {w: served[w] / n for w in sorted(served)}}

    async def unequal(self, rng: random.Random, n: int = 72, at_once: int = 6) -> dict:
        prompts = [words(rng, 50) for _ in range(n)]
        gate = asyncio.Semaphore(at_once)
        served: Counter = Counter()
        latencies: list[float] = []

        async def one(p: str) -> None:
            async with gate:
                _, wid, seconds = await self.chat([{"role": "user", "content": p}], 32)
                served[wid] += 1
                latencies.append(seconds)

        await asyncio.gather(*(one(p) for p in prompts))
        speeds = {w["id"]: (w["routing"]["speed"] or {}).get("decode_tokens_per_s")
                  for w in (await self.client.get("/workers")).json()["workers"]}
        return {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                "shares": {w: served[w] / n for w in sorted(speeds)}, "speeds": speeds}


def start(policy: str, slowdown: str, kv_cache_bytes: int) -> RouterProcess:
    return RouterProcess(["--simulate", "sm_80,sm_89,sm_90", "--routing", policy,
                          "--kv-cache-bytes", str(kv_cache_bytes)],
                         env={"HETSERVE_SLOWDOWN": slowdown}, fake=False, ready_timeout=300)


def shares_text(shares: dict[str, float]) -> str:
    return " ".join(f"{w} {v:.0%}" for w, v in sorted(shares.items()))


async def run(args) -> int:
    routers = [start(p, args.slowdown, args.kv_cache_bytes) for p in POLICIES]
    benches = {p: Bench(p, r) for p, r in zip(POLICIES, routers, strict=True)}
    results: dict[str, dict[str, dict]] = {p: {} for p in POLICIES}
    try:
        for p in POLICIES:
            await benches[p].warmup(random.Random(f"warmup-{p}"))
        for i, name in enumerate(("conversations", "shared_system_prompt", "unequal")):
            order = POLICIES if i % 2 == 0 else POLICIES[::-1]
            for p in order:
                print(f"  {name} on {p} ...", flush=True)
                before = await benches[p].reasons()
                results[p][name] = await getattr(benches[p], name)(random.Random(f"{name}-{args.seed}"))
                results[p][name]["reasons"] = dict((await benches[p].reasons()) - before)
        for p in POLICIES:
            await benches[p].client.aclose()
    finally:
        for r in routers:
            r.stop()
    return report(results, args.slowdown)


def report(results: dict[str, dict[str, dict]], slowdown: str) -> int:
    ca, ll = results["cache-aware"], results["least-loaded"]
    failed = []

    def check(ok: bool, what: str) -> str:
        if not ok:
            failed.append(what)
        return "ok" if ok else "MISSED"

    print(f"\nthree simulated workers of the embedded model, HETSERVE_SLOWDOWN={slowdown}; "
          "cache-aware vs least-loaded\n")
    a, b = ca["conversations"], ll["conversations"]
    hit_ratio = a["hit_rate"] / max(1e-9, b["hit_rate"])
    speedup = b["answering"] / a["answering"]
    print("(a) 24 conversations x 4 turns, history resent")
    print(f"    prefix cache hit rate   {a['hit_rate']:.1%} vs {b['hit_rate']:.1%}   {hit_ratio:.2f}x "
          f"(target >= 2x) {check(hit_ratio >= 2, 'hit rate')}")
    print(f"    total time answering    {a['answering']:.1f}s vs {b['answering']:.1f}s   {speedup:.2f}x faster "
          f"(target >= 1.3x) {check(speedup >= 1.3, 'chat time')}")
    print(f"    turn latency p50        {a['p50']:.3f}s vs {b['p50']:.3f}s; wall clock, users' pauses included, "
          f"{a['seconds']:.2f}s vs {b['seconds']:.2f}s")
    a, b = ca["shared_system_prompt"], ll["shared_system_prompt"]
    top = max(a["shares"].values())
    print("(b) 64 requests behind one system prompt")
    print(f"    shares                  {shares_text(a['shares'])}  vs  {shares_text(b['shares'])}")
    print(f"    largest share           {top:.0%} (target <= 60%) {check(top <= 0.6, 'shared prompt share')}")
    a, b = ca["unequal"], ll["unequal"]
    print("(c) unequal workers, no shared prefix, 6 at a time")
    print(f"    p50 / p99 latency       {a['p50']:.3f} / {a['p99']:.3f}s vs {b['p50']:.3f} / {b['p99']:.3f}s   "
          f"p99 {b['p99'] / a['p99']:.2f}x (target >= 1/{P99_NOISE:g}) "
          f"{check(a['p99'] <= P99_NOISE * b['p99'], 'p99')}")
    factors = {w: slowdown_factor(slowdown, w) for w in a["shares"]}
    fastest, slowest = min(factors, key=factors.get), max(factors, key=factors.get)
    ordered = a["shares"].get(fastest, 0) >= max(a["shares"].values()) and \
        a["shares"].get(slowest, 0) <= min(a["shares"].values())
    print("    measured decode tok/s   " + " ".join(f"{w} {s or 0:.0f}" for w, s in sorted(a["speeds"].items())))
    print(f"    shares                  {shares_text(a['shares'])}  vs  {shares_text(b['shares'])}   "
          f"fastest {fastest} most, slowest {slowest} least: {check(ordered, 'shares by speed')}")
    print("routing decisions (cache-aware): " + "; ".join(
        f"({k}) " + ", ".join(f"{r} {n}" for r, n in sorted(ca[name]["reasons"].items()))
        for k, name in zip("abc", ("conversations", "shared_system_prompt", "unequal"), strict=True)))
    print(f"\n{'all targets met' if not failed else 'MISSED: ' + ', '.join(failed)}")
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slowdown", default="gpu0=3,gpu1=1.5",
                   help="HETSERVE_SLOWDOWN for the workers (default %(default)s)")
    p.add_argument("--seed", default="0", help="seed of the generated texts")
    p.add_argument("--kv-cache-bytes", type=int, default=KV_CACHE_BYTES,
                   help="each worker's KV cache budget (default %(default)s)")
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
