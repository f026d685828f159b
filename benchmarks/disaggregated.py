"""Disaggregated prefill against today's routing, one server after the other in one run.

    python benchmarks/disaggregated.py                  # one fast-compute card, two slow-compute ones, auto
    python benchmarks/disaggregated.py --roles "--prefill gpu0 --decode gpu0,gpu1,gpu2"
    python benchmarks/disaggregated.py --simulate sm_90,sm_75 --slowdown cards --roles "--prefill gpu0"

Simulated workers of a random 4-layer stand-in of hidden size 384 (`--model`; the embedded 4M
model's prefill is too cheap for the phases to matter), by default three sm_90s, all slowed so that
the simulated devices, not the two shared CPU cores, bound the run: gpu0 2x at both phases, gpu1
and gpu2 as cards of an eighth of its compute and half its bandwidth (prefill 16x, decode 4x;
`HETSERVE_SLOWDOWN`). One server routes as today (every
worker does both phases, speed-weighted by the router); the other runs with `--roles` (by default
`--disaggregate auto`: the router measures each worker's prefill and decode speed and splits the
phases where the measured comparative advantage says it pays, then chooses per prompt where its
prefill runs from the measured speeds and queues) and `--disaggregate-min-prompt`. Each gets the
same seeded mixed workload at a fixed request rate (Poisson arrivals), first `--warmup` seconds
of it untimed (so the router has measured every worker), then `--requests` timed: long prompts
with short answers and short prompts with long answers, streamed (`/generate_stream`). Reported:
time to first token (p50, p99), time per output token (p50), throughput (generated tokens per
second of the run) and goodput (requests per second that met `--slo-ttft` and `--slo-tpot`); the
ratios disaggregated / today last. Rounds alternate which server goes first. `--identical` runs
`--roles` once more on the same devices unslowed and prints whether it split (auto should not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

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


async def drive(url: str, requests: list[tuple[str, int]], rate: float, seed: int, warmup_s: float,
                slo: tuple[float, float]) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one(client, requests[0][0], 2)  # warm up
        warm, t0 = [], time.perf_counter()
        while time.perf_counter() - t0 < warmup_s:  # untimed: every worker measured before the run
            prompt, max_tokens = requests[rng.randrange(len(requests))]
            warm.append(asyncio.create_task(one(client, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*warm)
        tasks = []
        t0 = time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(one(client, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    good = sum(1 for r in results if r["ttft"] <= slo[0] and r["tpot"] <= slo[1])
    return {"ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "tpot_p50": percentile([r["tpot"] for r in results], 0.5),
            "throughput": sum(r["tokens"] for r in results) / wall, "goodput": good / wall, "wall": wall}


def serve(simulate: str, slowdown: str, extra: list[str], model: Path | None = None) -> RouterProcess:
    env = {"HETSERVE_SLOWDOWN": slowdown} if slowdown else {}
    where = ["--model", str(model)] if model is not None else []
    return RouterProcess(["--simulate", simulate, "--dtype", "float32", *where, *extra], env=env, fake=False,
                         ready_timeout=300)


def stand_in(tmp: Path, size: str) -> Path | None:
    """`--model`: None for the embedded model, else a random llama of that hidden size (4 layers,
    a 2048-token context) whose prefill is compute enough for the phases to differ."""
    if size == "embedded":
        return None
    from tests.checkpoints import make_checkpoint

    hidden = int(size)
    return make_checkpoint(tmp / f"stand-in-{hidden}", hidden_size=hidden,
                           intermediate_size=hidden * 8 // 3 // 64 * 64, num_hidden_layers=4,
                           num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128),
                           vocab_size=4096, max_position_embeddings=2048, torch_dtype="float32")


def disagg_state(router: RouterProcess) -> str:
    """The handoff counters and each worker's role with the reason, as the router reports them."""
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    counters = [ln for ln in text.splitlines() if ln.startswith("hetserve_disagg_") and not ln.endswith(" 0.0")]
    workers = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
    roles = ", ".join(f"{w['id']} {w['disaggregation']['role']}" for w in workers)
    reason = workers[0]["disaggregation"]["reason"] if workers else ""
    return "\n  ".join([f"roles: {roles} ({reason})", *counters])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate", default="sm_90,sm_90,sm_90")
    ap.add_argument("--slowdown", default="gpu0=prefill:2,decode:2,gpu1=prefill:16,decode:4,gpu2=prefill:16,decode:4",
                    help="HETSERVE_SLOWDOWN for both servers (`cards`: each device as its catalog card)")
    ap.add_argument("--roles", default="--disaggregate auto")
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=2.5, help="requests per second (Poisson)")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds of untimed requests first")
    ap.add_argument("--long-words", type=int, default=130)  # about 390 tokens of the 512-token context
    ap.add_argument("--short-words", type=int, default=12)
    ap.add_argument("--long-answer", type=int, default=192)
    ap.add_argument("--short-answer", type=int, default=4)
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="goodput: time to first token at most (s)")
    ap.add_argument("--slo-tpot", type=float, default=0.1, help="goodput: time per output token at most (s)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="384", help="`embedded`, or a hidden size for a random 4-layer stand-in")
    ap.add_argument("--identical", action="store_true", help="then --roles on the devices unslowed")
    args = ap.parse_args()
    configs = {"today": [], "disaggregated": [*shlex.split(args.roles), "--disaggregate-min-prompt",
                                              str(args.min_prompt)]}
    slo = (args.slo_ttft, args.slo_tpot)
    results: dict[str, list[dict]] = {k: [] for k in configs}
    tmp = Path(tempfile.mkdtemp(prefix="hetserve-disagg-"))
    model = stand_in(tmp, args.model)
    for r in range(args.rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            router = serve(args.simulate, args.slowdown, configs[name], model)
            try:
                reqs = workload(args.seed + r, args.requests, args.long_words, args.short_words,
                                args.long_answer, args.short_answer)
                results[name].append(asyncio.run(drive(router.url, reqs, args.rate, args.seed + r, args.warmup, slo)))
                if name == "disaggregated":
                    print("  " + disagg_state(router))
            finally:
                router.stop()
    print(f"\n{args.simulate} slowed `{args.slowdown or 'none'}`; `{args.roles}`, prompts from {args.min_prompt} "
          f"tokens; {args.requests} requests at {args.rate}/s after {args.warmup:g} s of warm-up, half "
          f"{args.long_words} words -> {args.short_answer} tokens, half {args.short_words} words -> "
          f"{args.long_answer} tokens; goodput within {args.slo_ttft:g} s to the first token and "
          f"{args.slo_tpot:g} s per output token; {args.rounds} round(s)\n")
    print("| measure | today | disaggregated | ratio |\n| --- | ---: | ---: | ---: |")
    for key, label, unit in (("ttft_p50", "time to first token, p50", "s"), ("ttft_p99", "time to first token, p99",
                             "s"), ("tpot_p50", "time per output token, p50", "s"),
                             ("throughput", "throughput (tokens/s)", ""), ("goodput", "goodput (requests/s)", "")):
        a = sum(x[key] for x in results["today"]) / args.rounds
        b = sum(x[key] for x in results["disaggregated"]) / args.rounds
        print(f"| {label} | {a:.3f}{unit} | {b:.3f}{unit} | {b / a:.2f}x |")
    if args.identical:
        router = serve(args.simulate, "", configs["disaggregated"], model)
        try:
            reqs = workload(args.seed, args.requests // 2, args.long_words, args.short_words, args.long_answer,
                            args.short_answer)
            asyncio.run(drive(router.url, reqs, args.rate, args.seed, args.warmup, slo))
            print(f"\nidentical devices ({args.simulate}, unslowed), `{args.roles}`:\n  {disagg_state(router)}")
        finally:
            router.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
