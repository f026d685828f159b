"""Speculative decoding (n-gram drafts) against plain decoding on a CPU worker's engine, side by side.

    python benchmarks/speculative.py                  # the embedded model, bfloat16, 1 thread
    python benchmarks/speculative.py --rounds 5 --new-tokens 96 --compile auto

Design: the worker's engine is built in this process as `python -m workers` builds it on a CPU (load,
kernelize, the CPU paths, the KV cache without prefix caching, so a repeated prompt is computed
again), and each round runs every workload once without and once with speculation (the same engine,
its `Speculator` swapped), so the machine's drift falls on both alike:
  (a) code edits at concurrency 1: each prompt holds a text and ends where that text began (the
      embedded model's own continuation of a seed, then the seed again), so the model writes much
      of it again, as an edit request gets its file back with small changes; requests one by one;
  (b) random prompts at concurrency 16: random token ids, all submitted at once (the policy's
      batch rule should keep speculation from costing anything there).
Every request generates `--new-tokens` tokens (EOS ignored: the embedded model ends a bare prompt
at once, and equal lengths keep both sides' work alike). Prints output tokens/s of each side, their
ratio (speculative / plain; the median over rounds) and the acceptance rate. Trade-off: the engine
is driven on this thread (no HTTP, no engine thread), so the figures are the engine's own;
`benchmarks/engine.py` and `load_test.py` measure the rest.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # prefill.py's worker assembly

SEEDS = ["Tell me about grass.", "Name a fruit.", "Why is the sky blue?", "Tell me a joke.",
         "What is a good day?", "Give me a number.", "Say something wise.", "Hello!"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "workers" / "default_model", help="HF-layout checkpoint dir")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (a CPU worker on 2 cores has 1)")
    p.add_argument("--compile", default="off", choices=("off", "auto"), help="the plain decode step compiled or not")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--random-prompts", type=int, default=16)
    return p.parse_args(argv)


def build_engine(args):
    """The worker's engine for this process's CPU, as `run_worker` assembles it (no socket)."""
    from prefill import worker_engine

    from workers.contract import WorkerConfig
    from workers.contract.defaults import step_token_budget

    config = WorkerConfig(socket=str(ROOT / ".speculative-bench.sock"), compile=args.compile, threads=args.threads,
                          dtype=args.dtype, max_batch=max(16, args.random_prompts), no_prefix_cache=True,
                          max_num_batched_tokens=step_token_budget(True, max(16, args.random_prompts)),
                          speculative="ngram", num_speculative_tokens=args.k)
    built, loaded = worker_engine(config, args.model)
    built.compile()
    return built.engine, loaded.tokenizer


def serve(engine, prompts: list[list[int]], new_tokens: int, concurrency: int) -> tuple[int, float, list]:
    """Output tokens, seconds and token ids of `prompts` served `concurrency` at a time."""
    from workers.sampling.params import SamplingParams

    params = SamplingParams.create(max_new_tokens=new_tokens, ignore_eos=True)
    tokens, outputs, t0 = 0, [], time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        streams = [engine.submit(p, params) for p in prompts[i:i + concurrency]]
        while engine.step():
            pass
        for s in streams:
            outputs.append([e.token_id for e in s.events])
            tokens += len(s.events)
    return tokens, time.perf_counter() - t0, outputs


def main(argv=None) -> None:
    args = parse_args(argv)
    from workers.engine.speculate import Speculator
    from workers.spec.policy import SpecPolicy

    engine, tokenizer = build_engine(args)
    on, off = engine.speculator, Speculator("off", SpecPolicy(args.k), off_reason="benchmark: off")
    engine.speculator = off
    seeds = [tokenizer.encode(s).ids for s in SEEDS]
    continued = serve(engine, seeds, args.new_tokens, 1)[2]  # alone, as the edits will be served
    edits = [s + c + s for s, c in zip(seeds, continued, strict=True)]
    rng = random.Random(0)
    vocab = engine.runner.vocab_size or 1000
    randoms = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(args.random_prompts)]
    workloads = {"(a) code edits, concurrency 1": (edits, 1), "(b) random prompts, concurrency 16": (randoms, 16)}
    serve(engine, edits[:2], 8, 1)  # warm both paths
    engine.speculator = on
    serve(engine, edits[:2], 8, 1)
    ratios = {name: [] for name in workloads}
    rates = {name: [] for name in workloads}
    speeds = {name: {"plain": [], "speculative": []} for name in workloads}
    for _ in range(args.rounds):
        for name, (prompts, concurrency) in workloads.items():
            engine.speculator = off
            n0, s0, out0 = serve(engine, prompts, args.new_tokens, concurrency)
            before = (on.draft_tokens, on.accepted)
            engine.speculator = on
            n1, s1, out1 = serve(engine, prompts, args.new_tokens, concurrency)
            drafted, accepted = on.draft_tokens - before[0], on.accepted - before[1]
            speeds[name]["plain"].append(n0 / s0)
            speeds[name]["speculative"].append(n1 / s1)
            ratios[name].append((n1 / s1) / (n0 / s0))
            rates[name].append(accepted / drafted if drafted else 0.0)
            same = sum(a == b for a, b in zip(out0, out1, strict=True))
            print(f"  {name}: plain {n0 / s0:7.1f} tok/s, speculative {n1 / s1:7.1f} tok/s, "
                  f"acceptance {rates[name][-1]:.2f}, identical outputs {same}/{len(out0)}", flush=True)
    print(f"\nembedded model {args.dtype}, {args.threads} thread(s), --compile {args.compile}, k={args.k}, "
          f"{args.new_tokens} new tokens, {args.rounds} rounds (median):")
    for name in workloads:
        print(f"{name}: plain {statistics.median(speeds[name]['plain']):.1f} tok/s, speculative "
              f"{statistics.median(speeds[name]['speculative']):.1f} tok/s, ratio "
              f"{statistics.median(ratios[name]):.2f}x, acceptance {statistics.median(rates[name]):.2f}")


if __name__ == "__main__":
    main()
