"""Pipeline throughput, measured side by side in one run on the same checkpoint.

    python benchmarks/pipeline.py                         # a 8-layer stand-in of 62M parameters (bf16)
    python benchmarks/pipeline.py --model DIR --requests 16 --new-tokens 64 --slowdown 3

The default model is a random Llama of 8 layers, hidden 768 (tests/checkpoints.py): large
enough that a step's time is its layers' compute, as for the models pipelines are for, not
the fixed cost of a step (the embedded 4-layer model decodes 16 rows in about a millisecond,
where two processes' hand-offs cost as much as their layers). Real worker processes
(`python -m workers`, tests/pipeline_harness.py), 16 concurrent greedy requests of
`--new-tokens` tokens each (EOS ignored), all decode eager (a stage cannot compile its step;
the single worker runs `--compile off` too, so the two compare the same kernels):
(a) one worker with two CPU threads serving the whole model;
(b) a 2-stage pipeline, one CPU thread per stage, split as placement splits it (server/fleet/
    pipelines.py `plan_pipeline`: equal stages, the first charged for its serving work); two
    batches in flight, the default;
    b/a, target >= 0.8 (`--microbatches 1,2,4`: also with each step cut into micro-batches;
    `--batches 1`: also with another count of batches in flight, `--pipeline-batches`;
    `--partitions 4,4`: also with the layers split as given, `--pipeline-partition`);
(c) the same pipeline with its second stage slowed `--slowdown` times ($HETSERVE_SLOWDOWN), split
    by speed as placement splits it once the stages have served: its first start, split by the
    estimated speeds (1 and 1/slowdown, the serving charge), serves one round and records what
    its stages measured (workers/contract/stage_timing.py); placement then plans it again from
    that record, as every later `hetserve serve` does, and (c) runs that split;
(d) the same slowed pipeline split evenly; c/d, target >= 1.2;
(e) what the measurement bought: (c) against its first start's estimated split, side by side,
    and (b)'s split planned from what (b) recorded, against (b), where the two differ
    (`--no-measured`: (c) is the estimated split, and (e) is skipped).
Each pair runs alternately, each figure the best of `--repeats`. Exit code 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server.fleet.pipelines import plan_pipeline, timing_keys  # noqa: E402
from tests.pipeline_harness import Served  # noqa: E402
from workers.contract.model_size import read_config, read_profile  # noqa: E402
from workers.contract.stage_timing import read_timings, record_key  # noqa: E402
from workers.contract.topology import parse_simulate  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while each worker binds one device and picks its kernels".split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(12)) for i in range(n)]


def throughput(server: Served, texts: list[str], new_tokens: int) -> float:
    """Generated tokens per second with every request in flight at once."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        done = list(pool.map(lambda p: server.generate(p, new_tokens, ignore_eos=True), texts))
    wall = time.perf_counter() - t0
    tokens = sum(d["details"]["generated_tokens"] for d in done)
    return tokens / wall


def best_alternating(a: Served, b: Served, texts, new_tokens, repeats) -> tuple[float, float]:
    ra, rb = [], []
    for i in range(repeats):
        for server, out in ((a, ra), (b, rb)) if i % 2 == 0 else ((b, rb), (a, ra)):
            out.append(throughput(server, texts, new_tokens))
    return max(ra), max(rb)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a model directory (default: the stand-in)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slowdown", type=float, default=3.0)
    p.add_argument("--microbatches", default="1",
                   help="also run (b) with each step cut into these many micro-batches, e.g. 1,2,4 (the first is b)")
    p.add_argument("--partitions", nargs="*", default=[], metavar="N,N",
                   help="also run (b) with its layers split as given, e.g. 4,4 (--pipeline-partition)")
    p.add_argument("--batches", default="",
                   help="also run (b) with these many batches in flight at once, e.g. 2,3 (--pipeline-batches)")
    p.add_argument("--no-measured", action="store_true",
                   help="(c) split by the estimated speeds; skip (e), the splits planned from what was measured")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetserve-pipeline-") as tmp:
        if args.model is None:
            from tests.checkpoints import make_checkpoint

            args.model = make_checkpoint(Path(tmp) / "stand-in", hidden_size=768, intermediate_size=2048,
                                         num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                                         vocab_size=4096, torch_dtype="bfloat16")
        return run(args, Path(tmp))


def run(args, t: Path) -> int:
    n = int(read_config(args.model).get("num_hidden_layers"))
    common = ("--max-batch", str(args.requests), "--compile", "off")
    texts = prompts(args.requests)
    devices, profile = parse_simulate("sm_80,sm_86"), read_profile(args.model)
    slowdown = f"gpu1={args.slowdown:g}"
    placed = [s.layers for s in plan_pipeline("bench", profile, devices).splits]
    estimated = [s.layers for s in plan_pipeline("bench", profile, devices, slowdown=slowdown).splits]
    even = [n // 2, n - n // 2]
    path = t / "stage_timings.json"  # what (b) and the slowed first start record
    timings = {"HETSERVE_STAGE_TIMINGS": str(path)}
    slowed = {"HETSERVE_SLOWDOWN": ",".join(f"{name}-1={args.slowdown:g}" for name in ("slow_w", "slow_e", "slow_x")),
              **timings}
    hf = read_config(args.model)
    keys = {"": timing_keys(hf, devices, "auto", "none"), slowdown: timing_keys(hf, devices, "auto", "none", slowdown)}
    micro = [int(m) for m in args.microbatches.split(",")]
    flights = [int(k) for k in args.batches.split(",") if k]
    parts = [[int(x) for x in q.split(",")] for q in args.partitions]

    def pipeline(name: str, partition, env=None, **kw) -> Served:
        return Served(t, name, args.model, ["sm_80", "sm_86"], threads=1, common=common, partition=partition,
                      env=env, **kw)

    runs = {"one": Served(t, "one", args.model, ["sm_80"], threads=2, common=common),
            **{f"two{m}": pipeline(f"two{m}", placed, timings, extra=("--pipeline-microbatches", str(m)),
                                   timing=keys[""] if m == micro[0] else None) for m in micro},
            **{f"flight{k}": pipeline(f"flight{k}", placed, extra=("--pipeline-batches", str(k))) for k in flights},
            **{f"part{i}": pipeline(f"part{i}", q) for i, q in enumerate(parts)},
            "slow_e": pipeline("slow_e", even, slowed)}
    if not args.no_measured:  # the slowed pipeline's first start: the estimated split, recording
        runs["slow_x"] = pipeline("slow_x", estimated, slowed, timing=keys[slowdown])
    weighted = estimated
    try:
        for s in runs.values():
            s.wait_ready()
        for s in runs.values():  # warm up: first-step allocations, caches
            throughput(s, texts[:4], 8)
        if not args.no_measured:  # the first start serves a round, then placement plans from its record
            throughput(runs["slow_x"], texts, args.new_tokens)
            weighted = measured_split(profile, devices, slowdown, path)
        runs["slow_w"] = pipeline("slow_w", weighted, slowed)
        runs["slow_w"].wait_ready()
        throughput(runs["slow_w"], texts[:4], 8)
        a, b = best_alternating(runs["one"], runs[f"two{micro[0]}"], texts, args.new_tokens, args.repeats)
        more = {m: best_alternating(runs["one"], runs[f"two{m}"], texts, args.new_tokens, args.repeats)
                for m in micro[1:]}
        landed = {k: best_alternating(runs["one"], runs[f"flight{k}"], texts, args.new_tokens, args.repeats)
                  for k in flights}
        split = [best_alternating(runs["one"], runs[f"part{i}"], texts, args.new_tokens, args.repeats)
                 for i in range(len(parts))]
        c, d = best_alternating(runs["slow_w"], runs["slow_e"], texts, args.new_tokens, args.repeats)
        bought = {}
        if not args.no_measured:
            if weighted != estimated:
                bought["slowed"] = (estimated, weighted, best_alternating(runs["slow_x"], runs["slow_w"], texts,
                                                                          args.new_tokens, args.repeats))
            runs[f"two{micro[0]}"].stop()  # (b) records its last figures as it stops
            again = measured_split(profile, devices, "", path)
            if again != placed:
                runs["two_m"] = pipeline("two_m", again)
                runs["two_m"].wait_ready()
                throughput(runs["two_m"], texts[:4], 8)
                bought["unslowed"] = (placed, again, best_alternating(runs["one"], runs["two_m"], texts,
                                                                      args.new_tokens, args.repeats))
            else:
                bought["unslowed"] = (placed, again, None)
    finally:
        for s in runs.values():
            s.stop()
    print(f"model {args.model.name}: {n} layers, {args.requests} concurrent requests x {args.new_tokens} tokens")
    print(f"(a) one worker, 2 threads:            {a:8.1f} tokens/s")
    print(f"(b) 2-stage pipeline, 1 thread each, split {placed}: {b:8.1f} tokens/s   b/a = {b / a:.2f} "
          f"(target >= 0.8)")
    for m, (one, pipe) in more.items():
        print(f"    with {m} micro-batches per step:  {pipe:8.1f} tokens/s   "
              f"({pipe / one:.2f}x one worker's {one:.1f})")
    for k, (one, pipe) in landed.items():
        print(f"    with {k} batches in flight:       {pipe:8.1f} tokens/s   "
              f"({pipe / one:.2f}x one worker's {one:.1f})")
    for q, (one, pipe) in zip(parts, split, strict=True):
        print(f"    split {q}:                   {pipe:8.1f} tokens/s   ({pipe / one:.2f}x one worker's {one:.1f})")
    how = "estimated" if args.no_measured else f"measured (the first start's estimate: {estimated})"
    print(f"(c) stage 1 slowed {args.slowdown:g}x, split {weighted} by speed, {how}: {c:8.1f} tokens/s")
    print(f"(d) stage 1 slowed {args.slowdown:g}x, split {even} evenly:   {d:8.1f} tokens/s   c/d = {c / d:.2f} "
          f"(target >= 1.2)")
    for what, (first, measured, pair) in bought.items():
        if pair is None:
            print(f"(e) {what}: the split planned from what it measured is its first start's, {first}")
        else:
            x, y = pair
            print(f"(e) {what}: split {measured} as measured {y:8.1f} tokens/s against the first start's {first} "
                  f"{x:8.1f}: {y / x:.2f}x")
    return 0 if b / a >= 0.8 and c / d >= 1.2 else 1


def measured_split(profile, devices, slowdown: str, path: Path) -> list[int]:
    """The layers placement gives each stage from what was recorded in `path` (it must have been),
    the record printed."""
    timings = read_timings(path)
    group = plan_pipeline("bench", profile, devices, slowdown=slowdown, timings=timings)
    if "measured" not in group.reason:
        raise SystemExit(f"no usable record in {path} for this pipeline: {group.reason}")
    record = timings[record_key(group.timing_model, group.timing_devices)]
    print(f"recorded ({slowdown or 'unslowed'}): " + "; ".join(
        f"stage {i} {s.layers} layers, {s.per_layer * 1e3:.2f} ms per layer and step, {s.besides * 1e3:.2f} ms besides"
        for i, s in enumerate(record.stages)) + f" -> split {[s.layers for s in group.splits]}", flush=True)
    return [s.layers for s in group.splits]


if __name__ == "__main__":
    sys.exit(main())
