"""The paged KV cache on the embedded model, measured side by side in one run.

    python benchmarks/kv_cache.py                 # --threads 1 by default, like the other benchmarks

Prints three comparisons, each with its target:
  (a) prefix caching: 32 requests sharing a 384-token prefix, each with its own 16-token
      suffix and 16 new tokens, submitted at once; prefix cache on vs off: prompt tokens
      computed (target: >= 4x fewer) and wall time (target: >= 2x faster);
  (b) memory: at one fixed KV budget (8 sequences of the full 512-token context), 64
      requests with prompts of 16..400 tokens and 16 new tokens each; the most sequences
      running at once, paged (16-token blocks) vs the contiguous design, in which every
      sequence reserves a slot of the whole context (a block size of 512 reproduces it
      exactly) (target: >= 2x);
  (c) speed: the engine benchmark's b/a (the engine serving 32 requests x 64 tokens vs the
      bare batched loop, target >= 0.8), and decode tokens/s at batch 32 over paged blocks
      taken as the sequences grew (read through the CPU decode mirror) vs the contiguous
      cache, alternating step by step (the median of the per-step ratios, target >= 0.9x).
Decoding is greedy and ignores EOS, so every request makes exactly its new tokens, and the
outputs of the two sides of (a) and (b) are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine as engine_bench  # noqa: E402

from workers.contract import DEFAULT_MODEL_DIR  # noqa: E402
from workers.kv.batch import ForwardBatch, SeqChunk  # noqa: E402
from workers.kv.mirror import DecodeMirror  # noqa: E402
from workers.kv.pool import KVPool  # noqa: E402
from workers.model.loader import load_model  # noqa: E402
from workers.sampling.params import SamplingParams  # noqa: E402

CONTEXT = 512  # the embedded model's context


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: see the README)")
    p.add_argument("--block-size", type=int, default=16)
    return p.parse_args(argv)


def text_ids(tokenizer, n: int, salt: str) -> list[int]:
    """`n` token ids of English-like text (the engine benchmark's sentences, salted)."""
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += tokenizer.encode(f"{engine_bench.SENTENCES[i % len(engine_bench.SENTENCES)]} {salt}{i}. ").ids
        i += 1
    return ids[:n]


def serve(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], int]:
    """Submit every prompt at once and step the engine until all are done (no thread):
    (seconds, tokens of each request, most sequences running at once)."""
    params = SamplingParams.create(max_new_tokens=new_tokens)
    t0 = time.perf_counter()
    streams = [engine.submit(p, params) for p in prompts]
    peak = 0
    while engine.step():
        peak = max(peak, engine.scheduler.num_running)
    return time.perf_counter() - t0, [[e.token_id for e in s.events] for s in streams], peak


def prefill_computed(engine) -> int:
    return int(engine.metrics.prefill_tokens.labels("computed")._value.get())


# -- (a) prefix caching ------------------------------------------------------------------------


def prefix_caching(lm, block_size: int) -> dict:
    prefix = text_ids(lm.tokenizer, 384, "shared")
    prompts = [prefix + text_ids(lm.tokenizer, 16, f"q{i}-") for i in range(32)]
    rows = {}
    for cache in (False, True, False, True):  # alternated: noise hits both alike; best of two
        engine = engine_bench.make_engine(lm, 32, CONTEXT, block_size, prefix_cache=cache)
        seconds, out, _ = serve(engine, prompts, 16)
        best = rows.get(cache)
        if best is None or seconds < best[0]:
            rows[cache] = (seconds, prefill_computed(engine), out)
    same = sum(x == y for x, y in zip(rows[True][2], rows[False][2], strict=True))
    (t_off, c_off, _), (t_on, c_on, _) = rows[False], rows[True]
    print("\n(a) 32 requests sharing a 384-token prefix (+16 own tokens), 16 new tokens each")
    print(f"    {'prefix cache':14}{'prompt tokens computed':>24}{'seconds':>10}")
    print(f"    {'off':14}{c_off:>24}{t_off:>10.2f}")
    print(f"    {'on':14}{c_on:>24}{t_on:>10.2f}")
    print(f"    computed off/on = {c_off / c_on:.1f}x (target >= 4), time off/on = {t_off / t_on:.1f}x (target >= 2); "
          f"outputs equal for {same}/32 requests")
    return {"computed": c_off / c_on, "time": t_off / t_on}


# -- (b) memory ----------------------------------------------------------------------------------


def concurrency(lm, block_size: int) -> float:
    per_token = KVPool.bytes_per_token(lm.config, lm.dtype)
    budget = 8 * CONTEXT * per_token
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 401, (64,), generator=gen).tolist()
    prompts = [text_ids(lm.tokenizer, n, f"m{i}-") for i, n in enumerate(lengths)]
    rows = {}
    for name, bs in (("contiguous (one 512-token slot each)", CONTEXT),
                     (f"paged ({block_size}-token blocks)", block_size)):
        engine = engine_bench.make_engine(lm, 64, CONTEXT, bs, num_blocks=budget // (bs * per_token),
                                          prefix_cache=False)
        seconds, out, peak = serve(engine, prompts, 16)
        rows[name] = (peak, engine.scheduler.num_preemptions, seconds, out)
    outs = [r[3] for r in rows.values()]
    same = sum(x == y for x, y in zip(*outs, strict=True))
    print(f"\n(b) one KV budget ({budget} bytes = 8 x {CONTEXT} tokens), 64 requests of {min(lengths)}..{max(lengths)} "
          "prompt tokens + 16 new")
    print(f"    {'design':40}{'peak running':>14}{'preemptions':>13}{'seconds':>10}")
    for name, (peak, preempted, seconds, _) in rows.items():
        print(f"    {name:40}{peak:>14}{preempted:>13}{seconds:>10.2f}")
    (contiguous, *_), (paged, *_) = rows.values()
    print(f"    paged/contiguous = {paged / contiguous:.2f}x (target >= 2); outputs equal for {same}/64 requests")
    return paged / contiguous


# -- (c) speed -------------------------------------------------------------------------------------


def engine_ratio(lm) -> float:
    batch = engine_bench.prompts(lm.tokenizer, 32)
    cfg, model = lm.config, lm.model
    max_seq_len = max(map(len, batch)) + 64
    engine_bench.bare_loop(model, cfg, lm.dtype, batch[:4], 4)  # warm-up
    engine = engine_bench.make_engine(lm, 32, max_seq_len)
    engine.start()
    t_a, t_b = [], []
    try:
        engine_bench.engine_run(engine, batch[:4], 4, concurrent=True)  # warm-up
        for _ in range(3):  # alternated, best of three each
            t_a.append(engine_bench.bare_loop(model, cfg, lm.dtype, batch, 64)[0])
            t_b.append(engine_bench.engine_run(engine, batch, 64, True)[0])
    finally:
        engine.shutdown()
    n_tok = 32 * 64
    a, b = n_tok / min(t_a), n_tok / min(t_b)
    print("\n(c) speed")
    print(f"    engine, 32 concurrent requests x 64 tokens: {b:.0f} tok/s; bare batched loop: {a:.0f} tok/s; "
          f"b/a = {b / a:.2f} (target >= 0.8)")
    return b / a


class DecodeLoop:
    """Batch-32 decode of 64-token prompts over a pool laid out one way."""

    def __init__(self, lm, block_size: int, batch: int = 32, prompt_len: int = 64, steps: int = 64):
        self.model, self.bs, self.pos = lm.model, block_size, prompt_len
        per_seq = -(-(prompt_len + steps) // block_size)
        self.kv = KVPool.for_config(lm.config, batch * per_seq, block_size, lm.dtype)
        free = iter(range(batch * per_seq))
        # blocks taken in the order the engine takes them: every prompt's, then one more per row
        # whenever its next position starts a block (rows growing together interleave)
        self.tables = [[next(free) for _ in range(-(-prompt_len // block_size))] for _ in range(batch)]
        self._free = free
        self.mirror = DecodeMirror(self.kv) if block_size < CONTEXT else None
        prompt = list(range(3, 3 + prompt_len))
        with torch.inference_mode():
            for t in self.tables:
                self.model.step(ForwardBatch.build([(SeqChunk(0, prompt_len, t), prompt)], block_size), self.kv)

    def step(self) -> torch.Tensor:
        for t in self.tables:
            if self.pos == len(t) * self.bs:
                t.append(next(self._free))
        items = [(SeqChunk(self.pos, 1, t, key=i), [7]) for i, t in enumerate(self.tables)]
        with torch.inference_mode():
            out = self.model.step(ForwardBatch.build(items, self.bs, mirror=self.mirror), self.kv)
        self.pos += 1
        return out


def decode_ratio(lm, block_size: int, steps: int = 64) -> float:
    loops = {"contiguous": DecodeLoop(lm, CONTEXT, steps=steps), "paged": DecodeLoop(lm, block_size, steps=steps)}
    times = {name: [] for name in loops}
    for _ in range(steps):  # one step of each, alternately
        outs = {}
        for name, loop in loops.items():
            t0 = time.perf_counter()
            outs[name] = loop.step()
            times[name].append(time.perf_counter() - t0)
        torch.testing.assert_close(outs["paged"], outs["contiguous"], rtol=0, atol=0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    # paired: each step's two timings are taken back to back, so a burst of load hits both
    ratio = statistics.median(c / p for c, p in zip(times["contiguous"], times["paged"], strict=True))
    print(f"    decode at batch 32 (64-token prompts, {steps} steps): contiguous {32 / med['contiguous']:.0f} tok/s, "
          f"paged {32 / med['paged']:.0f} tok/s (median steps); paged/contiguous = {ratio:.2f} (median of the "
          "per-step ratios, target >= 0.9); logits bit-identical")
    return ratio


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(DEFAULT_MODEL_DIR, "float32")
    cfg = lm.config
    print(f"model: embedded ({cfg.num_parameters / 1e6:.1f}M params, {cfg.num_hidden_layers} layers, "
          f"context {cfg.max_position_embeddings}, {lm.dtype}), {args.threads} thread(s), block size {args.block_size}")
    a = prefix_caching(lm, args.block_size)
    b = concurrency(lm, args.block_size)
    c_engine = engine_ratio(lm)
    c_decode = decode_ratio(lm, args.block_size)
    met = a["computed"] >= 4 and a["time"] >= 2 and b >= 2 and c_engine >= 0.8 and c_decode >= 0.9
    print(f"\nall targets met: {'yes' if met else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
