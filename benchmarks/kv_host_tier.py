"""The host KV tier on the embedded model: a multi-turn workload with and without it, side by side in one run.

    python benchmarks/kv_host_tier.py             # --threads 1 by default, like the other benchmarks
    python benchmarks/kv_host_tier.py --arch qwen3_5   # a hybrid: its prefixes through state snapshots

`--conversations` conversations take `--turns` turns in round robin; each turn resends the whole
history plus `--user-tokens` new tokens and generates `--new-tokens` greedy tokens, so prompts grow
from `--first-tokens` to about 450 tokens (the embedded model's context is 512). The device pool
of each engine holds about a quarter of the live contexts at the last turn, so by its next turn a
conversation's prefix has been evicted. The two engines (no tier; a tier in /dev/shm) serve the
same requests alternately, one request at a time, and print side by side:
  (a) time to first token of the later turns (2 onwards), p50 and p99 (target: p50 >= 3x lower);
  (b) prompt tokens computed over the later turns;
  (c) a conversation continued on a second engine of the same format (another worker): prompt
      tokens it computes, with the tier and without.
  (d) two requests of `--first-tokens` + 128 generated tokens on an engine holding one and a half
      of them: the step that resumes a preempted one, by recompute (no tier) and by swap (the
      tier), and the tokens each recomputes.
  (e) a stream that moves to another engine after `--moved-after` of its 128 tokens, as when its
      worker shuts down: the time the old engine takes to publish its KV to the tier (and know it
      written), the new engine's time to its first resumed token, and the prompt tokens it
      computes, by recompute (no tier) and from the tier.
Every request's tokens are checked equal on both sides.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kv_cache import text_ids  # noqa: E402  (the KV benchmark's English-like prompts)

from tests.prefill_count import count_prefill  # noqa: E402
from workers.contract import DEFAULT_MODEL_DIR  # noqa: E402
from workers.engine.core import Engine  # noqa: E402
from workers.engine.runner import ModelRunner  # noqa: E402
from workers.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from workers.kv.hashing import root_hash  # noqa: E402
from workers.kv.pool import KVPool  # noqa: E402
from workers.kv.snapshots import PER_SEQUENCE  # noqa: E402
from workers.kvtier.publish import publish  # noqa: E402
from workers.kvtier.tier import HostTier  # noqa: E402
from workers.model.loader import load_model  # noqa: E402
from workers.sampling.params import SamplingParams  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--first-tokens", type=int, default=192)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--moved-after", type=int, default=64)
    p.add_argument("--arch", default="embedded",
                   help="`embedded` (the default model) or a family of tests/family_checkpoints.py at benchmark "
                        "size, e.g. `qwen3_5` (a hybrid: its state snapshots, workers/kv/snapshots.py)")
    return p.parse_args(argv)


class Side:
    """One engine (with or without the tier) and what it computed."""

    def __init__(self, lm, blocks: int, block: int, tier_dir: str | None, sequences: int = 1):
        hybrid = bool(lm.config.state_layers)  # its state's running slots and snapshot slots, as a worker sizes them
        spare = PER_SEQUENCE * sequences if hybrid else 0
        pool = KVPool.for_config(lm.config, blocks, block, lm.dtype, "cpu", state_slots=sequences + spare)
        root = root_hash(lm.model_id, lm.dtype, "none", block)
        config = SchedulerConfig(sequences, lm.config.context_length, blocks, block, 1024, True, cache_root=root,
                                 state_slots=sequences if hybrid else 0, state_snapshots=spare)
        self.engine = Engine(ModelRunner(lm.model, pool, "cpu"), Scheduler(config), lm.tokenizer, max_queue=4)
        self.tier = None
        if tier_dir is not None:
            self.tier = HostTier.open(pool, root, tier_dir, 4 << 30)
            self.engine.attach_tier(self.tier)
        count_prefill(self)

    def serve(self, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
        """(time to first token, tokens) of one request served alone."""
        params = SamplingParams.create(max_new_tokens=new_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        stream = self.engine.submit(ids, params)
        ttft = None
        while self.engine.step():
            if ttft is None and stream.events:
                ttft = time.perf_counter() - t0
        if self.tier is not None:
            self.tier.flush()  # the writer's work: off the request's path, not timed
        return ttft, [e.token_id for e in stream.events]


def resume_times(side: Side, prompts: list[list[int]], new_tokens: int) -> tuple[list[float], list[list[int]]]:
    """Serve `prompts` together on an engine too small for all of them (preemptions follow): the
    duration of each step that took a preempted sequence back, and every request's tokens."""
    engine, sched = side.engine, side.engine.scheduler
    streams = [engine.submit(ids, SamplingParams.create(max_new_tokens=new_tokens, ignore_eos=True)) for ids in prompts]
    times = []
    while True:
        resuming = bool(sched.waiting) and sched.waiting[0].computed_at_preemption > 0
        t0 = time.perf_counter()
        if not engine.step():
            break
        if resuming and sched.waiting and sched.waiting[0].computed_at_preemption > 0:
            resuming = False  # it did not fit yet
        if resuming:
            times.append(time.perf_counter() - t0)
    if side.tier is not None:
        side.tier.flush()
    return times, [[e.token_id for e in s.events] for s in streams]


def moved_stream(lm, blocks: int, bs: int, tier_dir: str | None, ids: list[int], after: int,
                 total: int) -> tuple[float, float, int, list[int]]:
    """A stream served by one engine for `after` tokens, then continued on a second (`resume_ids`)
    as the router moves it: (the first engine's publish time, 0 without a tier; the second's time
    to its first token; the prompt tokens the second computes; every token of the stream)."""
    first, second = Side(lm, blocks, bs, tier_dir), Side(lm, blocks, bs, tier_dir)
    params = SamplingParams.create(max_new_tokens=total, ignore_eos=True)
    stream = first.engine.submit(ids, params)
    while len(stream.events) < after:
        first.engine.step()
    sent = [e.token_id for e in stream.events]
    t_pub = 0.0
    if tier_dir is not None:
        t0 = time.perf_counter()
        publish(first.engine.scheduler.kv, list(first.engine.scheduler.running))
        t_pub = time.perf_counter() - t0
    t0 = time.perf_counter()
    resumed = second.engine.submit(ids, params, resume_ids=sent)
    ttft = None
    while second.engine.step():
        if ttft is None and resumed.events:
            ttft = time.perf_counter() - t0
    for side in (first, second):
        if side.tier is not None:
            side.tier.close()
    return t_pub, ttft, second.prefill, sent + [e.token_id for e in resumed.events]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main(argv=None) -> int:
    args = parse_args(argv)
    tier_dir = tempfile.mkdtemp(prefix="hetserve-kv-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    try:
        return run(args, tier_dir)
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)


def run(args, tier_dir: str) -> int:
    torch.set_num_threads(args.threads)
    model = DEFAULT_MODEL_DIR
    if args.arch != "embedded":
        from tests.family_checkpoints import make_bench_checkpoint

        model = make_bench_checkpoint(args.arch, Path(tier_dir).with_name(Path(tier_dir).name + "-model"))
    lm = load_model(model, "float32")
    if args.arch != "embedded":
        shutil.rmtree(model, ignore_errors=True)
    bs = args.block_size
    last = args.first_tokens + (args.turns - 1) * (args.user_tokens + args.new_tokens) + args.new_tokens
    # a quarter of the live contexts, and at least one conversation's longest turn
    blocks = max(-(-(last + args.user_tokens) // bs) + 1, args.conversations * last // bs // 4)
    plain, tiered = Side(lm, blocks, bs, None), Side(lm, blocks, bs, tier_dir)
    print(f"{args.conversations} conversations x {args.turns} turns, prompts {args.first_tokens}..{last} tokens; "
          f"device pool {blocks} blocks x {bs} tokens ({blocks * bs} of {args.conversations * last} live tokens); "
          f"tier {tier_dir}")
    history = [text_ids(lm.tokenizer, args.first_tokens, f"c{c}t0") for c in range(args.conversations)]
    ttft = {"plain": [], "tier": []}
    later = {"plain": 0, "tier": 0}
    for turn in range(args.turns):
        for c in range(args.conversations):
            before = (plain.prefill, tiered.prefill)
            tp, out_p = plain.serve(history[c], args.new_tokens)
            tt, out_t = tiered.serve(history[c], args.new_tokens)
            if out_p != out_t:
                raise SystemExit(f"conversation {c} turn {turn}: the tier changed the tokens")
            if turn:
                ttft["plain"].append(tp)
                ttft["tier"].append(tt)
                later["plain"] += plain.prefill - before[0]
                later["tier"] += tiered.prefill - before[1]
            history[c] = history[c] + out_p + text_ids(lm.tokenizer, args.user_tokens, f"c{c}t{turn + 1}")
    # (c) conversation 0's next turn on a second engine of the same format, with and without the tier
    second, alone = Side(lm, blocks, bs, tier_dir), Side(lm, blocks, bs, None)
    turn_ids = history[0][: min(lm.config.context_length, blocks * bs) - args.new_tokens]
    _, out_s = second.serve(turn_ids, args.new_tokens)
    _, out_a = alone.serve(turn_ids, args.new_tokens)
    if out_s != out_a:
        raise SystemExit("the second engine's tokens differ with the tier")
    # (d) two long requests on a pool that holds one and a half of them: one is preempted and resumed
    swap_blocks = 3 * -(-(args.first_tokens + 128) // bs) // 2
    swap_ids = [text_ids(lm.tokenizer, args.first_tokens, f"swap{i}") for i in range(2)]
    by_recompute, by_swap = Side(lm, swap_blocks, bs, None, 2), Side(lm, swap_blocks, bs, tier_dir, 2)
    t_rec, out_r = resume_times(by_recompute, swap_ids, 128)
    t_swap, out_s = resume_times(by_swap, swap_ids, 128)
    if out_r != out_s:
        raise SystemExit("a sequence resumed by swap gave other tokens than one resumed by recompute")
    swap_row = (f"| (d) a preempted sequence's resume step, median of {len(t_rec)} / {len(t_swap)} | "
                f"{statistics.median(t_rec) * 1e3:.1f} ms | {statistics.median(t_swap) * 1e3:.1f} ms | "
                f"{statistics.median(t_rec) / statistics.median(t_swap):.2f}x lower | |" if t_rec and t_swap
                else "| (d) no preemption happened | | | | |")
    recomputed = (by_recompute.engine.scheduler.num_recomputed_tokens, by_swap.engine.scheduler.num_recomputed_tokens)
    # (e) a stream moved to a second engine after --moved-after tokens: by recompute, and with its KV published
    moved_ids = text_ids(lm.tokenizer, args.first_tokens, "moved")
    _, undisturbed = Side(lm, blocks, bs, None).serve(moved_ids, 128)
    _, m_ttft_r, m_prefill_r, m_out_r = moved_stream(lm, blocks, bs, None, moved_ids, args.moved_after, 128)
    m_pub, m_ttft_t, m_prefill_t, m_out_t = moved_stream(lm, blocks, bs, tier_dir, moved_ids, args.moved_after, 128)
    if not m_out_r == m_out_t == undisturbed:
        raise SystemExit("a moved stream's tokens differ from the undisturbed run's")
    p50 = (statistics.median(ttft["plain"]), statistics.median(ttft["tier"]))
    p99 = (pct(ttft["plain"], 0.99), pct(ttft["tier"], 0.99))
    print("| measure | without tier | with tier | ratio | target |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(f"| (a) TTFT of turns 2..{args.turns}, p50 | {p50[0] * 1e3:.1f} ms | {p50[1] * 1e3:.1f} ms | "
          f"{p50[0] / p50[1]:.2f}x lower | >= 3x |")
    print(f"| (a) the same, p99 | {p99[0] * 1e3:.1f} ms | {p99[1] * 1e3:.1f} ms | {p99[0] / p99[1]:.2f}x lower | |")
    print(f"| (b) prompt tokens computed, turns 2..{args.turns} | {later['plain']} | {later['tier']} | "
          f"{later['plain'] / max(1, later['tier']):.1f}x fewer | |")
    print(f"| (c) a conversation continued on a second engine ({len(turn_ids)} tokens): prompt tokens computed | "
          f"{alone.prefill} | {second.prefill} | {alone.prefill / max(1, second.prefill):.1f}x fewer | |")
    print(swap_row)
    print(f"| (d) the same: tokens recomputed on resume | {recomputed[0]} | {recomputed[1]} | | |")
    print(f"| (e) a stream moved after {args.moved_after} tokens: the new engine's first token | "
          f"{m_ttft_r * 1e3:.1f} ms | {m_ttft_t * 1e3:.1f} ms | {m_ttft_r / m_ttft_t:.2f}x lower | |")
    print(f"| (e) the same: prompt tokens the new engine computes | {m_prefill_r} | {m_prefill_t} | | |")
    print(f"| (e) the same: the old engine publishing its KV (written, acknowledged) | | {m_pub * 1e3:.1f} ms | | |")
    d = tiered.tier.describe()
    snaps = (f", {d['state_snapshots_written']} state snapshots written ({tiered.tier.format.state_bytes} bytes "
             f"each), {d['state_snapshots_loaded']} loaded" if "state_snapshots_written" in d else "")
    print(f"tier: {d['blocks_written']} blocks written, {d['blocks_loaded']} loaded, {d['used_bytes']} bytes{snaps}; "
          "every request's tokens equal on both sides")
    for side in (tiered, second, by_swap):
        side.tier.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
