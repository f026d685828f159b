"""Engine throughput, measured side by side in one run on the same checkpoint.

    python benchmarks/engine.py                  # the embedded model (or a stand-in of its size)
    python benchmarks/engine.py --model DIR --requests 32 --new-tokens 64 --threads 2

Prints generated tokens per second for
  (a) a bare batched loop: one prefill of all prompts, then one `model.step` + argmax per
      token for the whole batch, no scheduler, no sampling, no detokenization, each sequence
      in its own run of KV blocks (the copy-free strided view: the ceiling);
  (b) the engine serving all requests concurrently (thread, scheduler, sampler, streaming
      text to asyncio consumers, as the HTTP side reads them);
  (c) the same requests through the engine one at a time;
  (d) transformers `generate`, one request at a time, on the same checkpoint;
and the ratios b/a (target >= 0.8), b/c (>= 5), b/d (>= 5). Then, in bfloat16 (the served
default), the engine serving all requests concurrently
  (e) in the default mode (projections' rows padded to buckets, as a CPU worker runs them);
  (f) with `--deterministic` (workers/model/deterministic.py: fixed row tiles, fixed attention splits);
run alternately, and f/e (target >= 0.6). With `--compile`, in float32 again, the engine with its
decode step compiled (workers/engine/compiled.py: Inductor, as `--compile on` runs a CPU worker;
buckets 1 and `--requests`, the only batch sizes this load decodes at)
  (g) serving all requests concurrently, g/b against an eager engine run alternately with it;
  (h) one request at a time, h/c likewise;
with the compile time and whether its tokens equal the eager engine's. Decoding is greedy and ignores
EOS so every request makes exactly `--new-tokens` tokens. The machines are shared and
noisy: each figure is the best of `--repeats` runs, and (a) and (b) are run alternately.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.contract import DEFAULT_KV_BLOCK_SIZE, DEFAULT_MODEL_DIR  # noqa: E402
from workers.engine.compiled import CompiledDecode, scratch_groups  # noqa: E402
from workers.engine.core import Engine  # noqa: E402
from workers.engine.runner import ModelRunner  # noqa: E402
from workers.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from workers.kv.batch import ForwardBatch, SeqChunk  # noqa: E402
from workers.kv.groups import same_blocks  # noqa: E402
from workers.kv.pool import KVPool, layer_shapes  # noqa: E402
from workers.model.cpu_projections import install_cpu_projections  # noqa: E402
from workers.model.deterministic import enable_deterministic  # noqa: E402
from workers.model.loader import load_model  # noqa: E402
from workers.sampling.params import SamplingParams  # noqa: E402

SENTENCES = [
    "The quick brown fox jumps over the lazy dog and keeps running",
    "Once upon a time there was a little language model that could",
    "A heterogeneous host has GPUs of different architectures in one box",
    "Hello, world! This is a small benchmark of the batched engine",
    "Each worker binds one device, then picks its kernels and its fp8 convention",
    "What is the capital of France? Paris is the capital of France",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "def main():\n    print('hello')\n    return 0",
]
# The embedded model's shape (scripts/train_default_model.py), for a stand-in when it is absent.
STAND_IN = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                max_position_embeddings=512)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="HF-layout model dir (default: embedded model, else a stand-in)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads for every mode (1: see the README)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-hf", action="store_true", help="skip (d), transformers generate")
    p.add_argument("--compile", action="store_true",
                   help="also (g), (h): the engine with its decode step compiled "
                        "(Inductor; a minute or more to compile)")
    return p.parse_args(argv)


def model_dir(args, tmp: Path) -> tuple[Path, str]:
    if args.model:
        return args.model, str(args.model)
    default = DEFAULT_MODEL_DIR
    if (default / "config.json").is_file():
        return default, "embedded model (workers/default_model)"
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(tmp / "stand-in", **STAND_IN)
    return path, "stand-in checkpoint of the embedded model's shape (tests/checkpoints.py)"


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(SENTENCES[i % len(SENTENCES)] + f" #{i}").ids for i in range(n)]


def best(fn, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


# -- (a) the ceiling -------------------------------------------------------------------------


def bare_loop(model, cfg, dtype, batch: list[list[int]], new_tokens: int,
              block_size: int = DEFAULT_KV_BLOCK_SIZE) -> tuple[float, list[list[int]]]:
    per_seq = -(-(max(map(len, batch)) + new_tokens) // block_size)
    kv = KVPool.for_config(cfg, len(batch) * per_seq, block_size, dtype, "cpu")
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(batch))]  # a run of blocks each
    out = [[] for _ in batch]
    t0 = time.perf_counter()
    with torch.inference_mode():
        items = [(SeqChunk(0, len(p), tables[i]), p) for i, p in enumerate(batch)]
        for _ in range(new_tokens):
            ids = model.step(ForwardBatch.build(items, block_size, "cpu"), kv).argmax(-1).tolist()
            items = []
            for i, t in enumerate(ids):
                out[i].append(t)
                items.append((SeqChunk(len(batch[i]) + len(out[i]) - 1, 1, tables[i]), [t]))
    return time.perf_counter() - t0, out


# -- (b), (c) the engine ---------------------------------------------------------------------


def make_engine(loaded, n_seqs: int, max_seq_len: int, block_size: int = DEFAULT_KV_BLOCK_SIZE,
                num_blocks: int | None = None, prefix_cache: bool = True, mirror: bool = True,
                buckets: tuple[int, ...] = (), **config) -> Engine:
    """An engine over a pool of `num_blocks` (default: `n_seqs` sequences of `max_seq_len`);
    `buckets`: the decode step compiled for these batch sizes (Inductor), as a worker with
    `--compile on` runs it (a scratch block per group for the pad rows); (): eager."""
    num_blocks = num_blocks or n_seqs * -(-max_seq_len // block_size)
    groups = scratch_groups(same_blocks(loaded.config.layer_windows, num_blocks, layer_shapes(loaded.config))) \
        if buckets else None
    kv = KVPool.for_config(loaded.config, num_blocks, block_size, loaded.dtype, "cpu", groups)
    compiled = CompiledDecode(loaded.model, kv, "cpu", buckets, "inductor") if buckets else None
    sched = Scheduler(SchedulerConfig(n_seqs, loaded.config.max_position_embeddings, num_blocks, block_size,
                                      prefix_caching=prefix_cache, eos_token_ids=(), **config))  # ignore EOS
    return Engine(ModelRunner(loaded.model, kv, "cpu", mirror=mirror, compiled=compiled), sched, loaded.tokenizer,
                  max_queue=1024)


async def _consume(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    stream = engine.submit(prompt, params, asyncio.get_running_loop())
    ids, text = [], []
    async for e in stream:
        ids.append(e.token_id)
        text.append(e.text)
    return ids


def engine_run(engine: Engine, batch: list[list[int]], new_tokens: int, concurrent: bool) -> tuple[float, list]:
    params = SamplingParams.create(max_new_tokens=new_tokens)

    async def main():
        if concurrent:
            return await asyncio.gather(*(_consume(engine, p, params) for p in batch))
        return [await _consume(engine, p, params) for p in batch]

    t0 = time.perf_counter()
    out = asyncio.run(main())
    return time.perf_counter() - t0, out


# -- (d) transformers ------------------------------------------------------------------------


def hf_run(path: Path, batch: list[list[int]], new_tokens: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # fixed lengths, as in (a)-(c)
    model.generation_config.pad_token_id = 0

    def run() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for p in batch:
                ids = torch.tensor([p])
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - t0

    run_one = batch[:1]
    with torch.inference_mode():
        model.generate(torch.tensor(run_one), max_new_tokens=4, do_sample=False)  # warm-up
    return best(run, repeats)


# -- (e), (f) deterministic mode -------------------------------------------------------------


def deterministic_cost(path: Path, batch: list[list[int]], new_tokens: int, repeats: int):
    """(seconds default, seconds deterministic, requests whose tokens agree), bfloat16, concurrent."""
    engines = []
    for deterministic in (False, True):
        loaded = load_model(path, "bfloat16")
        install_cpu_projections(loaded.model, "cpu", loaded.dtype, experts=not deterministic)  # as a CPU worker
        if deterministic:
            enable_deterministic(loaded.model)
        engine = make_engine(loaded, len(batch), max(map(len, batch)) + new_tokens, mirror=not deterministic)
        engine.start()
        engines.append(engine)
    try:
        outs = [engine_run(e, batch, new_tokens, True)[1] for e in engines]  # warm-up, and the tokens
        times = [[], []]
        for _ in range(repeats):  # alternated, so a burst of load hits both
            for i, e in enumerate(engines):
                times[i].append(engine_run(e, batch, new_tokens, True)[0])
    finally:
        for e in engines:
            e.shutdown()
    same = sum(x == y for x, y in zip(*outs, strict=True))
    return min(times[0]), min(times[1]), same


# -- (g), (h) the compiled decode step --------------------------------------------------------


def compiled_cost(loaded, batch: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Seconds of an eager engine and of one whose decode step is compiled for batch sizes 1
    and `len(batch)` (float32), run alternately: `b` and `g` concurrent, `c` and `h` one at a
    time; with the compile seconds and the requests whose tokens agree."""
    max_len = max(map(len, batch)) + new_tokens
    engines = {"eager": make_engine(loaded, len(batch), max_len),
               "compiled": make_engine(loaded, len(batch), max_len, buckets=(1, len(batch)))}
    seconds = engines["compiled"].runner.compiled.warm()
    for e in engines.values():
        e.start()
    try:
        outs = [engine_run(e, batch, new_tokens, True)[1] for e in engines.values()]  # warm-up, and the tokens
        t = {k: [] for k in "bgch"}
        for _ in range(repeats):  # alternated, so a burst of load hits both
            t["b"].append(engine_run(engines["eager"], batch, new_tokens, True)[0])
            t["g"].append(engine_run(engines["compiled"], batch, new_tokens, True)[0])
        for _ in range(repeats):
            t["c"].append(engine_run(engines["eager"], batch, new_tokens, False)[0])
            t["h"].append(engine_run(engines["compiled"], batch, new_tokens, False)[0])
    finally:
        for e in engines.values():
            e.shutdown()
    return {**{k: min(v) for k, v in t.items()}, "compile_s": seconds,
            "same": sum(x == y for x, y in zip(*outs, strict=True))}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path, label = model_dir(args, Path(tmp))
        loaded = load_model(path, "float32")
        cfg = loaded.config
        batch = prompts(loaded.tokenizer, args.requests)
        max_seq_len = max(map(len, batch)) + args.new_tokens
        n_tok = args.requests * args.new_tokens
        print(f"model: {label}: {cfg.num_parameters / 1e6:.1f}M params, hidden {cfg.hidden_size}, "
              f"{cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, {loaded.dtype}")
        print(f"work: {args.requests} requests x {args.new_tokens} new tokens (prompts "
              f"{min(map(len, batch))}-{max(map(len, batch))} tokens), {args.threads} threads, best of {args.repeats}")

        bare_loop(loaded.model, cfg, loaded.dtype, batch[:4], 4)  # warm-up
        _, ref = bare_loop(loaded.model, cfg, loaded.dtype, batch, args.new_tokens)
        engine = make_engine(loaded, args.requests, max_seq_len)
        engine.start()
        try:
            engine_run(engine, batch[:4], 4, concurrent=True)  # warm-up
            _, out_b = engine_run(engine, batch, args.new_tokens, True)
            t_a, t_b = [], []
            for _ in range(args.repeats):  # (a) and (b) alternated, so a burst of load hits both
                t_a.append(bare_loop(loaded.model, cfg, loaded.dtype, batch, args.new_tokens)[0])
                t_b.append(engine_run(engine, batch, args.new_tokens, True)[0])
            t_a, t_b = min(t_a), min(t_b)
            t_c = best(lambda: engine_run(engine, batch, args.new_tokens, False)[0], args.repeats)
        finally:
            engine.shutdown()
        t_d = None if args.skip_hf else hf_run(path, batch, args.new_tokens, args.repeats)
        t_e, t_f, same_ef = deterministic_cost(path, batch, args.new_tokens, args.repeats)
        comp = compiled_cost(loaded, batch, args.new_tokens, args.repeats) if args.compile else {}
        t_g, t_h = comp.get("g"), comp.get("h")


    times = (("a", t_a), ("b", t_b), ("c", t_c), ("d", t_d), ("e", t_e), ("f", t_f), ("g", t_g), ("h", t_h))
    rate = {k: n_tok / t for k, t in times if t}
    rows = [("a", "bare batched loop (ceiling)"), ("b", "engine, concurrent"), ("c", "engine, one at a time"),
            ("d", "transformers generate, one at a time"), ("e", "engine, concurrent, bfloat16"),
            ("f", "engine, concurrent, bfloat16, deterministic"), ("g", "engine, concurrent, compiled step"),
            ("h", "engine, one at a time, compiled step")]
    print(f"\n{'':3}{'mode':46}{'tokens/s':>10}{'seconds':>10}")
    for key, name in rows:
        if key in rate:
            print(f"({key}) {name:46}{rate[key]:10.0f}{n_tok / rate[key]:10.2f}")
    same = sum(x == y for x, y in zip(out_b, ref, strict=True))
    print(f"\nengine tokens equal to the bare loop's: {same}/{len(ref)} requests")
    print(f"b/a = {rate['b'] / rate['a']:.2f}  (target >= 0.8)")
    print(f"b/c = {rate['b'] / rate['c']:.1f}  (target >= 5)")
    if "d" in rate:
        print(f"b/d = {rate['b'] / rate['d']:.1f}  (target >= 5)")
    print(f"f/e = {rate['f'] / rate['e']:.2f}  (target >= 0.6; deterministic vs default at batch {args.requests}, "
          f"bfloat16; tokens equal in {same_ef}/{len(batch)} requests)")
    if comp:
        print(f"g/b = {comp['b'] / comp['g']:.2f}, h/c = {comp['c'] / comp['h']:.2f}  (compiled vs eager step, "
              f"concurrent and one at a time, run alternately: eager {n_tok / comp['b']:.0f} and "
              f"{n_tok / comp['c']:.0f} tok/s; compiled in {comp['compile_s']:.0f} s; tokens equal in "
              f"{comp['same']}/{len(batch)} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
