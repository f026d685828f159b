"""Disaggregated prefill against today's routing, one server after the other in one run.

    python benchmarks/disaggregated.py                       # sm_90 beside sm_75, slowed as `cards`
    python benchmarks/disaggregated.py --roles "--prefill gpu0 --decode gpu1" --rate 2 --requests 48

Two simulated workers of the embedded model (by default an sm_90 and an sm_75), each slowed as
its catalog card against the sm_90 this CPU plays (`HETSERVE_SLOWDOWN=cards`: the sm_75's
prefill by the TFLOPS ratio, its decode by the GB/s ratio). One server routes as today (every
worker does both phases, speed-weighted by the router); the other runs with `--roles` (by
default `--prefill gpu0 --decode gpu0,gpu1`: long prompts are prefilled only on the fast card,
and their decode goes wherever the router finds room) and `--disaggregate-min-prompt`. Each
gets the same seeded mixed workload at a fixed request rate (Poisson arrivals): long prompts
with short answers and short prompts with long answers, streamed (`/generate_stream`), and
reports time to first token (p50, p99), time per output token (p50), and throughput (generated
tokens per second of the run); the ratios disaggregated / today are printed last. Rounds
alternate which server goes first. A few minutes on two shared cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from router_harness import RouterProcess  # noqa: E402

WORDS = (ROOT / "workers" / "default_model" / "corpus_words.txt").read_text().split()


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


def workload(seed: int, n: int, long_words: int, short_words: int, long_answer: int,
             short_answer: int) -> list[tuple[str, int]]:
    """Half long prompts with short answers, half short prompts with long answers, shuffled."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            out.append((" ".join(rng.choices(WORDS, k=long_words)), short_answer))
        else:
            out.append((" ".join(rng.choices(WORDS, k=short_words)), long_answer))
    rng.shuffle(out)
    return out


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_tokens, "ignore_eos": True}}
    t0 = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", "/generate_stream", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode(errors='replace')}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if event.get("token"):
                tokens += 1
                first = first or time.perf_counter()
    end = time.perf_counter()
    return {"ttft": first - t0, "tpot": (end - first) / max(1, tokens - 1), "tokens": tokens}


async def drive(url: str, requests: list[tuple[str, int]], rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one(client, requests[0][0], 2)  # warm up
        tasks = []
        t0 = time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(one(client, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    return {"ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "tpot_p50": percentile([r["tpot"] for r in results], 0.5),
            "throughput": sum(r["tokens"] for r in results) / wall, "wall": wall}


def serve(simulate: str, extra: list[str]) -> RouterProcess:
    return RouterProcess(["--simulate", simulate, "--dtype", "float32", *extra],
                         env={"HETSERVE_SLOWDOWN": "cards"}, fake=False, ready_timeout=300)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate", default="sm_90,sm_75")
    ap.add_argument("--roles", default="--prefill gpu0 --decode gpu0,gpu1")
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    ap.add_argument("--long-words", type=int, default=130)  # about 390 tokens of the 512-token context
    ap.add_argument("--short-words", type=int, default=12)
    ap.add_argument("--long-answer", type=int, default=48)
    ap.add_argument("--short-answer", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    configs = {"today": [], "disaggregated": [*shlex.split(args.roles), "--disaggregate-min-prompt",
                                              str(args.min_prompt)]}
    results: dict[str, list[dict]] = {k: [] for k in configs}
    for r in range(args.rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            router = serve(args.simulate, configs[name])
            try:
                reqs = workload(args.seed + r, args.requests, args.long_words, args.short_words,
                                args.long_answer, args.short_answer)
                results[name].append(asyncio.run(drive(router.url, reqs, args.rate, args.seed + r)))
                if name == "disaggregated":
                    text = httpx.get(f"{router.url}/metrics", timeout=10).text
                    handed = [ln for ln in text.splitlines() if ln.startswith("hetserve_disagg_")]
                    print("  " + "\n  ".join(handed))
            finally:
                router.stop()
    print(f"\n{args.simulate} slowed as cards; roles `{args.roles}`, prompts from {args.min_prompt} tokens handed "
          f"off; {args.requests} requests at {args.rate}/s, half {args.long_words} words -> {args.short_answer} "
          f"tokens, half {args.short_words} words -> {args.long_answer} tokens; {args.rounds} round(s)\n")
    print("| measure | today | disaggregated | ratio |\n| --- | ---: | ---: | ---: |")
    for key, label, unit in (("ttft_p50", "time to first token, p50", "s"), ("ttft_p99", "time to first token, p99",
                             "s"), ("tpot_p50", "time per output token, p50", "s"),
                             ("throughput", "throughput (tokens/s)", "")):
        a = sum(x[key] for x in results["today"]) / args.rounds
        b = sum(x[key] for x in results["disaggregated"]) / args.rounds
        print(f"| {label} | {a:.3f}{unit} | {b:.3f}{unit} | {b / a:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
