"""LoRA adapters mixed in one batch against the base model alone, on the same worker, side by side.

    python benchmarks/lora.py                       # the embedded model, bfloat16, 1 thread
    python benchmarks/lora.py --requests 32 --rounds 5 --rank 16

Design: the worker's engine is built in this process as `python -m workers` builds it on this
machine (prefill.py's assembly) with a table of 16 LoRA adapters that PEFT itself writes over the
same checkpoint (random A and B, rank `--rank`, every projection PEFT can target: q, k, v, o, gate,
up, down; tests/lora_adapters.py), `--max-loras 8`. Each round serves the same `--requests`
random prompts, all submitted at once so that every step batches them: once on the base model, then
with 1, 4 and 8 adapters spread over the requests round-robin (each step then mixes that many
adapters), then 16 over the 8 slots (half the adapters wait in host memory until a slot frees), the
cases interleaved round by round so the machine's drift falls on all alike. Every request generates
`--new-tokens` tokens (EOS ignored). Prints output tokens/s per case (median over rounds), its ratio
to the base model (the median of each round's ratio), each case's time to first token p99, and the
16-adapter case's p99 against the 8-adapter case's (the adapter-thrash cliff). On a CPU the delta is
the torch path, its adapters in float32 (workers/lora/worker.py `adapter_dtype`); on a GPU, the
segmented Triton kernel (kernels_local/lora_sgmv/). Trade-off: the engine is driven on this thread
(no HTTP, no engine thread), so the figures are the engine's own; a step holding any adapter row
runs eager, so with `--compile auto` the base model's compiled decode step is compared with eager
adapter steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # prefill.py's worker assembly

ADAPTER_COUNTS = (1, 4, 8)
SLOTS = 8  # --max-loras: the 16-adapter case reads half its adapters back from host memory as slots free
THRASH = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "workers" / "default_model", help="HF-layout checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (a CPU worker on 2 cores has 1)")
    p.add_argument("--compile", default="off", choices=("off", "auto"), help="the base decode step compiled or not")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32, help="requests served at once")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rank", type=int, default=8)
    return p.parse_args(argv)


def write_adapters(model: Path, out: Path, count: int, rank: int) -> list[tuple[str, Path]]:
    """`count` PEFT adapters over `model`, written by PEFT into `out`: (name, directory)."""
    from tests.lora_adapters import make_adapter

    return [(f"a{i}", make_adapter(model, out / f"a{i}", seed=i, r=rank, alpha=2.0 * rank, std=0.05))
            for i in range(count)]


def build_engine(args, adapters: list[tuple[str, Path]]):
    """The worker's engine for this process's device with `adapters` in its LoRA table (no socket)."""
    from prefill import worker_engine

    from workers.contract import WorkerConfig
    from workers.contract.defaults import step_token_budget
    from workers.lora.worker import build_loras

    config = WorkerConfig(socket=str(ROOT / ".lora-bench.sock"), compile=args.compile, threads=args.threads,
                          dtype=args.dtype, max_batch=args.requests, no_prefix_cache=True,
                          max_num_batched_tokens=step_token_budget(True, args.requests),
                          lora=",".join(f"{n}={p}" for n, p in adapters), max_loras=SLOTS,
                          max_lora_rank=max(16, args.rank))
    built, loaded = worker_engine(config, args.model)
    built.compile()
    built.engine.loras = build_loras(config, loaded, next(loaded.model.parameters()).device)
    return built.engine


def serve(engine, prompts: list[list[int]], new_tokens: int, loras: list[str | None]) -> tuple[int, float]:
    """Output tokens, seconds and each request's time to first token (s) of `prompts` submitted at
    once, request i with adapter `loras[i]`."""
    from workers.sampling.params import SamplingParams

    params = SamplingParams.create(max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    streams = [engine.submit(p, params, lora=lora) for p, lora in zip(prompts, loras, strict=True)]
    first: dict[int, float] = {}
    while engine.step():
        now = time.perf_counter()
        for i, s in enumerate(streams):
            if i not in first and s.events:
                first[i] = now - t0
    return sum(len(s.events) for s in streams), time.perf_counter() - t0, sorted(first.values())


def p99(values: list[float]) -> float:
    return values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_adapters(args.model, Path(tmp), THRASH, args.rank)
        engine = build_engine(args, adapters)
        names = [n for n, _ in adapters]
        rng = random.Random(0)
        vocab = engine.runner.vocab_size or 1000
        prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
        cases = {"base": [None] * args.requests}
        for n in (*ADAPTER_COUNTS, THRASH):
            cases[f"{n} adapter{'s' if n > 1 else ''}"] = [names[i % n] for i in range(args.requests)]
        for loras in cases.values():  # warm every path
            serve(engine, prompts[:SLOTS], 4, loras[:SLOTS])
        speeds: dict[str, list[float]] = {name: [] for name in cases}
        ttfts: dict[str, list[list[float]]] = {name: [] for name in cases}
        for r in range(args.rounds):
            for name, loras in cases.items():
                tokens, seconds, ttft = serve(engine, prompts, args.new_tokens, loras)
                speeds[name].append(tokens / seconds)
                ttfts[name].append(ttft)
            print(f"  round {r + 1}: " + ", ".join(f"{n} {s[-1]:.1f} tok/s" for n, s in speeds.items()), flush=True)
    print(f"\n{args.model.name} {args.dtype}, {args.threads} thread(s), --compile {args.compile}, "
          f"{args.requests} requests at once, {args.prompt_tokens} prompt + {args.new_tokens} new tokens, "
          f"rank {args.rank} on q/k/v/o/gate/up/down, {args.rounds} rounds (median):")
    for name in cases:
        ratio = statistics.median(s / b for s, b in zip(speeds[name], speeds["base"], strict=True))
        ttft = statistics.median(p99(t) for t in ttfts[name]) * 1e3
        print(f"  {name:<11} {statistics.median(speeds[name]):8.1f} tok/s  {ratio:5.2f}x the base model   "
              f"TTFT p99 {ttft:7.1f} ms")
    thrash = statistics.median(p99(a) / p99(b) for a, b in zip(ttfts[f"{THRASH} adapters"], ttfts["8 adapters"],
                                                                strict=True))
    print(f"\n{THRASH} adapters over --max-loras {SLOTS}: TTFT p99 {thrash:.2f}x the 8-adapter case's (target <= 3x)")


if __name__ == "__main__":
    main()
