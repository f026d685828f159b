"""Speculative decoding against plain decoding on CPU workers' engines, side by side in one run.

    python benchmarks/speculative.py --rounds 3       # the embedded model, bfloat16, 1 thread
    python benchmarks/speculative.py --method ngram --k 6 --new-tokens 96

Design: the worker's engine is built in this process as `python -m workers` builds it on a CPU (load,
kernelize, the CPU paths, the KV cache without prefix caching, so a repeated prompt is computed
again), with `--speculative METHOD` and its measured choice of k (workers/spec/policy.py, what `auto`
runs where it speculates), and each round runs every workload once without and once with speculation
(the same engine, its `Speculator` swapped, which side goes first alternating), so the machine's
drift falls on both alike:
  (a) code edits at concurrency 1: each prompt holds a text and ends where that text began (the
      embedded model's own continuation of a seed, then the seed again), so the model writes much
      of it again, as an edit request gets its file back with small changes; requests one by one;
  (b) random prompts at concurrency 16: random token ids, all submitted at once (the measured
      choice should keep speculation from costing anything there);
  (c) an MTP checkpoint at concurrency 1 (`--mtp-model DIR`, a checkpoint shipping `mtp.*` tensors, served
      with `--speculative mtp` on an engine of its own; the code edits made from its own continuations);
      printed as not run without one;
  (d) devices of different costs, each its own engine and policy serving the code edits
      `--d-concurrency` at a time: this CPU, the same slowed `--slowdown` times (the simulated slow
      device, workers/device/slowdown.py) and a memory-bound one (a fixed `--memory-ms` added to each
      forward whatever its query tokens, as an older GPU's weight reads); each one's steps per
      chosen k and speed-up.
Every request generates `--new-tokens` tokens (EOS ignored: the embedded model ends a bare prompt
at once, and equal lengths keep both sides' work alike). Prints output tokens/s of each side, their
ratio (speculative / plain; the median over rounds), the acceptance rate and how many outputs equal
plain decoding's. Trade-off: the engine is driven on this thread (no HTTP, no engine thread), so
the figures are the engine's own; `benchmarks/engine.py` and `load_test.py` measure the rest.
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
    p.add_argument("--method", default="suffix", choices=("suffix", "ngram"), help="--speculative")
    p.add_argument("--random-prompts", type=int, default=16)
    p.add_argument("--only", default="abcd", help="the scenarios to run, e.g. `b` or `ad`")
    p.add_argument("--mtp-model", type=Path, default=None, help="(c): a checkpoint with an MTP head")
    p.add_argument("--d-concurrency", type=int, default=4, help="(d): code edits served this many at a time")
    p.add_argument("--slowdown", type=float, default=4.0, help="(d): the slowed device's factor")
    p.add_argument("--memory-ms", type=float, default=20.0, help="(d): the memory-bound device's ms per forward")
    return p.parse_args(argv)


def build_engine(args):
    """The worker's engine for this process's CPU, as `run_worker` assembles it (no socket)."""
    from prefill import worker_engine

    from workers.contract import WorkerConfig
    from workers.contract.defaults import step_token_budget

    config = WorkerConfig(socket=str(ROOT / ".speculative-bench.sock"), compile=args.compile, threads=args.threads,
                          dtype=args.dtype, max_batch=max(16, args.random_prompts), no_prefix_cache=True,
                          max_num_batched_tokens=step_token_budget(True, max(16, args.random_prompts)),
                          speculative=args.method, num_speculative_tokens=args.k)
    built, loaded = worker_engine(config, args.model)
    built.compile()
    return built.engine, loaded


def memory_bound(model, seconds: float) -> None:
    """Add `seconds` to every forward of `model`, whatever its query tokens (a weight-read-bound device)."""
    step = model.step

    def bound(*a, **kw):
        out = step(*a, **kw)
        time.sleep(seconds)
        return out

    model.step = bound


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


def side_by_side(engine, on, off, prompts, concurrency, new_tokens, spec_first: bool) -> dict:
    """One plain and one speculative pass of `prompts` on `engine` (the speculative one first when
    `spec_first`): speeds, ratio, acceptance, steps per k chosen."""
    before, chosen = (on.draft_tokens, on.accepted), dict(on.chosen)
    runs = {}
    for name, speculator in ((("spec", on), ("plain", off)) if spec_first else (("plain", off), ("spec", on))):
        engine.speculator = speculator
        runs[name] = serve(engine, prompts, new_tokens, concurrency)
    (n0, s0, out0), (n1, s1, out1) = runs["plain"], runs["spec"]
    drafted, accepted = on.draft_tokens - before[0], on.accepted - before[1]
    return {"plain": n0 / s0, "spec": n1 / s1, "ratio": (n1 / s1) / (n0 / s0),
            "acceptance": accepted / drafted if drafted else 0.0,
            "same": sum(a == b for a, b in zip(out0, out1, strict=True)), "n": len(out0),
            "k": {k: n - chosen.get(k, 0) for k, n in on.chosen.items() if n - chosen.get(k, 0)}}


def pair(engine, k: int):
    """(the engine's own speculator, a plain one) to swap."""
    from workers.engine.speculate import Speculator
    from workers.spec.policy import SpecPolicy

    return engine.speculator, Speculator("off", SpecPolicy(k), off_reason="benchmark: off")


def show(name: str, r: dict) -> str:
    return (f"{name}: plain {r['plain']:7.1f} tok/s, speculative {r['spec']:7.1f} tok/s, {r['ratio']:.2f}x, "
            f"acceptance {r['acceptance']:.2f}, identical outputs {r['same']}/{r['n']}, steps per k "
            f"{dict(sorted(r['k'].items()))}")


def median(results: list[dict]) -> dict:
    out = {key: statistics.median(r[key] for r in results) for key in ("plain", "spec", "ratio", "acceptance")}
    ks: dict[int, int] = {}
    for r in results:
        for k, n in r["k"].items():
            ks[k] = ks.get(k, 0) + n
    return out | {"same": sum(r["same"] for r in results), "n": sum(r["n"] for r in results), "k": ks}


def mtp_rounds(args) -> list[dict]:
    """(c): `--mtp-model` served with its MTP head against plain decoding, code edits one at a time."""
    mtp_args = argparse.Namespace(**{**vars(args), "model": args.mtp_model, "method": "mtp"})
    engine, loaded = build_engine(mtp_args)
    on, off = pair(engine, args.k)
    engine.speculator = off
    seeds = [loaded.tokenizer.encode(s).ids for s in SEEDS]
    edits = [s + c + s for s, c in zip(seeds, serve(engine, seeds, args.new_tokens, 1)[2], strict=True)]
    results = []
    for round_ in range(args.rounds):
        results.append(side_by_side(engine, on, off, edits, 1, args.new_tokens, round_ % 2 == 1))
        print("  " + show("(c) MTP checkpoint", results[-1]), flush=True)
    return results


def main(argv=None) -> None:
    args = parse_args(argv)
    from workers.contract.slowdown import Slowdown
    from workers.device.slowdown import apply_slowdown

    engine, loaded = build_engine(args)
    tokenizer = loaded.tokenizer
    on, off = pair(engine, args.k)
    engine.speculator = off
    seeds = [tokenizer.encode(s).ids for s in SEEDS]
    continued = serve(engine, seeds, args.new_tokens, 1)[2]  # alone, as the edits will be served
    edits = [s + c + s for s, c in zip(seeds, continued, strict=True)]
    rng = random.Random(0)
    vocab = engine.runner.vocab_size or 1000
    randoms = [[rng.randrange(10, vocab) for _ in range(64)] for _ in range(args.random_prompts)]
    workloads = {"(a) code edits, concurrency 1": (edits, 1), "(b) random prompts, concurrency 16": (randoms, 16)}
    workloads = {name: w for name, w in workloads.items() if name[1] in args.only}
    devices = {"this CPU": engine} if "d" in args.only else {}
    if devices:
        slowed, slowed_loaded = build_engine(args)
        apply_slowdown(slowed_loaded.model, Slowdown(args.slowdown, args.slowdown, "benchmark"))
        devices[f"slowed x{args.slowdown:g}"] = slowed
        bound, bound_loaded = build_engine(args)
        memory_bound(bound_loaded.model, args.memory_ms / 1e3)
        devices[f"memory-bound +{args.memory_ms:g} ms"] = bound
    warm = devices or {"this CPU": engine}
    pairs = {name: (on, off) if e is engine else pair(e, args.k) for name, e in warm.items()}
    for name, e in warm.items():  # warm both paths
        for speculator in pairs[name][::-1]:
            e.speculator = speculator
            serve(e, edits[:2], 8, 1)
    results = {name: [] for name in workloads} | {f"(d) {name}": [] for name in devices}
    for round_ in range(args.rounds):
        first = round_ % 2 == 1  # the order alternates, so the machine's drift favours neither side
        for name, (prompts, concurrency) in workloads.items():
            results[name].append(side_by_side(engine, on, off, prompts, concurrency, args.new_tokens, first))
            print("  " + show(name, results[name][-1]), flush=True)
        for name, e in devices.items():
            r = side_by_side(e, *pairs[name], edits, args.d_concurrency, args.new_tokens, first)
            results[f"(d) {name}"].append(r)
            print("  " + show(f"(d) {name}", r), flush=True)
    print(f"\nembedded model {args.dtype}, {args.threads} thread(s), --compile {args.compile}, --speculative "
          f"{args.method}, k <= {args.k}, {args.new_tokens} new tokens, {args.rounds} rounds (median):")
    for name in workloads:
        print(show(name, median(results[name])))
    if "c" in args.only and args.mtp_model is None:
        print("(c) MTP checkpoint, concurrency 1: not run: no checkpoint with an MTP head given (`--mtp-model DIR`)")
    elif "c" in args.only:
        print(show(f"(c) MTP checkpoint {args.mtp_model.name}, concurrency 1", median(mtp_rounds(args))))
    if devices:
        print(f"(d) code edits, concurrency {args.d_concurrency}, one engine per device:")
    for name in devices:
        r = median(results[f"(d) {name}"])
        print("    " + show(name, r) + f"; step ms {pairs[name][0].costs.describe()}")


if __name__ == "__main__":
    main()
