"""Decode-step time: our `Transformer.step` with its paged KV cache vs transformers with its own
KV cache (DynamicCache), on the same checkpoint and dtype, measured side by side, per family.

Design: each round times one decode step of ours (the worker's, then eager's where they
differ), then one of each of transformers' attention implementations, at every batch size,
so machine noise hits all alike; the median over rounds is reported, with the ratio against
the faster of theirs (transformers / ours: above 1 means ours is faster). Theirs is timed
under both SDPA and eager attention by default because neither wins everywhere on a CPU
(eager is the faster in bfloat16 at batch 32, SDPA in float32); both compute the model as its
reference does, and an architecture SDPA cannot compute (Gemma 2's soft-capped scores) runs
eager only. The output names each implementation.

Ours runs as a CPU worker runs its decode step: kernelized for the CPU (the layers the worker
installs, e.g. the experts' grouped GEMM), its projections and experts through oneDNN with packed
weights (workers/model/cpu_projections.py), and, under `--compile auto` (the worker's default),
compiled per batch bucket where the worker compiles it (workers/engine/compiled.py `decide`:
Inductor, rows attending in place through their block tables, an MoE layer's experts one
opaque op), eager where the model cannot compile (linear-attention state, a dynamic rotary),
always over a paged pool whose
blocks the sequences took as they grew together (every read goes through the block tables;
eager reads them through the decode mirror), each chunk carrying its prompt's length where the
rotary depends on it. Where it compiles, the eager step is timed too (`eager ms`, its ratio
beside); `--compile off` times eager only, `--compile on` refuses a model that cannot compile.
Compiling a batch's bucket takes 10-25 s on 2 cores, before timing. Theirs runs
`model(next, cache=...)` with the `DynamicCache` its `generate` would build (sliding layers
keep only their window). Every row of a batch has its own prompt and decodes its own token
(identical rows would send every token of an MoE layer to the same experts). Before timing, the
first decode step's fp32 logits of both are compared (within 1e-3), so both sides are known to
compute the same model. Trade-off: one step
is a few milliseconds, so the figures carry the Python overhead of both sides, which is what a
decode step costs on a CPU at this size; a larger model would weigh the matmuls more, on both
sides alike.

`--arch llama` (the default) times the Llama checkpoint of `tests/checkpoints.py` (`MODEL`),
as this benchmark always has; every other family in the registry (`--arch all`: each one)
times `tests/family_checkpoints.py`'s case for it at the same size (`bench_config`: hidden
256, 4 layers, vocab 4096) with the family's options on (sliding layers whose window, 48, is
shorter than the 64-token prompt, Gemma 2's soft-caps, Phi-3's partial rotary and LongRoPE
past its original length, ...).

    python benchmarks/decode_vs_transformers.py --threads 1 [--arch llama qwen3 gemma3 phi3 | all]
        [--dtype float32 bfloat16] [--batch 1 32] [--hf-attn fastest|auto|sdpa|eager] [--compile auto|on|off]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.model.families.registry import FAMILIES  # noqa: E402

MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
ARCHES = tuple(FAMILIES)  # every family in the registry
HF_ATTN = ("fastest", "auto", "sdpa", "eager")  # fastest: both timed, the faster compared; auto: transformers' pick


def benchmarkable() -> list[str]:
    """The registry's families that have a checkpoint to time: llama's, and each one with a case in
    tests/family_checkpoints.py (a family joins when its parity case does)."""
    from tests.family_checkpoints import CASES

    return [a for a in ARCHES if a == "llama" or a in CASES]


def arch_names(values: Sequence[str]) -> list[str]:
    """The families `--arch` names (`all`: every benchmarkable one), in registry order; a
    `ValueError` naming an unknown one, or one without a checkpoint case, and listing the supported."""
    ok = benchmarkable()
    bad = [v for v in values if v != "all" and v not in ok]
    if bad:
        why = ("has no checkpoint case in tests/family_checkpoints.py" if bad[0] in FAMILIES
               else "is not in the registry")
        raise ValueError(f"Architecture `{bad[0]}` {why}. Supported: {', '.join(ok)}, all")
    wanted = set(ok) if "all" in values else set(values)
    return [a for a in ok if a in wanted]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", nargs="+", default=["llama"], metavar="ARCH",
                        help="families of the registry to time, or all (default: llama)")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per implementation")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                        help="our decode step as a CPU worker's --compile runs it (default auto: compiled "
                             "where the model can be, and eager timed beside it)")
    parser.add_argument("--hf-attn", default="fastest", choices=HF_ATTN,
                        help="transformers' attention implementation (fastest: SDPA and eager both timed, "
                             "ours compared with the faster; auto: transformers' own pick)")
    args = parser.parse_args(argv)
    try:
        args.arch = arch_names(args.arch)
    except ValueError as e:
        parser.error(str(e))
    return args


def row_prompt(row: int, length: int) -> list[int]:
    """Row `row`'s prompt: its own tokens, so the rows of a batch differ (identical rows would
    route every token of an MoE layer to the same experts, which a batch of requests does not)."""
    return [3 + (row * 7 + i) % 4000 for i in range(length)]


def next_token(row: int) -> int:
    """The token row `row` decodes at every step (its own, for the same reason)."""
    return 7 + row


class Ours:
    """The engine's decode path on the CPU: a paged pool whose blocks the sequences took as they
    grew together (interleaved, so every read goes through the block tables), stepped eager
    through the decode mirror, or (`compiled`) by the worker's compiled decode of one bucket."""

    def __init__(self, lm, batch: int, prompt_len: int, max_len: int, block_size: int = 16,
                 compiled: bool = False, in_place: bool | None = None) -> None:
        """`in_place`: decode rows attend through the C++ kernel (None: where a CPU worker would,
        kernels_local/paged_attention/cpu.py)."""
        from kernels_local.paged_attention import cpu as cpu_decode
        from workers.engine.compiled import CompiledDecode, scratch_groups
        from workers.kv.batch import ForwardBatch, SeqChunk
        from workers.kv.groups import same_blocks
        from workers.kv.mirror import DecodeMirror
        from workers.kv.pool import KVPool, layer_shapes

        self.model, self.batch, self.pos, self.bs = lm.model, batch, prompt_len, block_size
        self.in_place = cpu_decode.in_place("cpu") if in_place is None else in_place
        self.chunk, self.build = SeqChunk, ForwardBatch.build
        # a rotary that depends on the prompt's length gets it, as the engine's runner passes it
        self.rope_len = prompt_len if self.model.rope_threshold is not None else 0
        per_seq = -(-max_len // block_size)
        if compiled:  # as the worker makes it: one scratch block per KV group for the bucket's pad rows
            groups = scratch_groups(same_blocks(lm.config.layer_windows, batch * per_seq, layer_shapes(lm.config)))
            self.kv = KVPool.for_config(lm.config, batch * per_seq, block_size, lm.dtype, "cpu", groups)
        else:
            self.kv = self.model.new_kv_pool(batch * per_seq, block_size, state_slots=batch)  # slot s: sequence s
        self.tables = [[s + batch * j for j in range(per_seq)] for s in range(batch)]
        # as the engine's runner: a pool of several KV groups (sliding layers) gets their windows,
        # and the mirror copies the first group's rows only when that group attends in full
        windows = getattr(self.kv, "windows", None)
        self.extra = {} if windows is None else {"windows": windows}
        self.mirror = DecodeMirror(self.kv) if not (compiled or self.in_place) and (not windows or windows[0] is None) \
            else None
        for s in range(batch):
            chunk = SeqChunk(0, prompt_len, self.tables[s], rope_len=self.rope_len, state_slot=s)
            self.model.step(ForwardBatch.build([(chunk, row_prompt(s, prompt_len))], block_size, **self.extra), self.kv)
        self.decode, self.compile_s = None, 0.0
        if compiled:
            self.decode = CompiledDecode(self.model, self.kv, "cpu", (batch,), "inductor", in_place=self.in_place)
            self.compile_s = self.decode.warm()
            self.seq = SimpleNamespace(group_tables=(), rope_len=self.rope_len)

    def step(self) -> torch.Tensor:
        if self.decode is not None:
            chunks = [SimpleNamespace(start_pos=self.pos, token_ids=[next_token(s)], block_table=self.tables[s],
                                      samples=True, seq=self.seq) for s in range(self.batch)]
            logits = self.decode.run(chunks)
        else:
            items = [(self.chunk(self.pos, 1, self.tables[s], key=s, rope_len=self.rope_len, state_slot=s),
                      [next_token(s)]) for s in range(self.batch)]
            logits = self.model.step(self.build(items, self.bs, mirror=self.mirror, in_place=self.in_place,
                                                **self.extra), self.kv)
        self.pos += 1
        return logits


class Theirs:
    def __init__(self, model, batch: int, prompt_len: int) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        ids = torch.tensor([row_prompt(s, prompt_len) for s in range(batch)])
        with torch.inference_mode():
            model(ids, cache=self.cache, use_cache=True)
        self.next = torch.tensor([[next_token(s)] for s in range(batch)])
        self.pos = prompt_len

    def step(self) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(self.next, cache=self.cache, use_cache=True, cache_position=torch.tensor([self.pos]))
        self.pos += 1
        return out.logits[:, -1].float()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def checkpoint(arch: str, out: Path) -> tuple[Path, str]:
    """(directory, what it is) of `arch`'s benchmark checkpoint."""
    if arch == "llama":
        from tests.checkpoints import make_checkpoint

        return make_checkpoint(out, **MODEL), f"tests/checkpoints.py {MODEL}"
    from tests.family_checkpoints import bench_config, make_bench_checkpoint

    model_type, options = bench_config(arch)
    def brief(v):
        if isinstance(v, dict):
            return {k: brief(x) for k, x in v.items()}
        return f"[{len(v)} values]" if isinstance(v, list) and len(v) > 4 else v

    shown = {k: brief(v) for k, v in options.items() if k not in ("pad_token_id", "bos_token_id", "eos_token_id")}
    return make_bench_checkpoint(arch, out), f"tests/family_checkpoints.py bench_config({arch!r}): {model_type} {shown}"


def hf_models(ckpt: Path, dtype: str, choice: str) -> dict:
    """transformers' models of the checkpoint, one per attention implementation `choice` asks for
    (`fastest`: SDPA and eager, those the architecture supports; `auto`: its own pick)."""
    from transformers import AutoModelForCausalLM

    wanted = ("sdpa", "eager") if choice == "fastest" else (None,) if choice == "auto" else (choice,)
    models = {}
    for impl in wanted:
        extra = {} if impl is None else {"attn_implementation": impl}
        try:
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype), **extra).eval()
        except ValueError:  # SDPA cannot compute this architecture (soft-capped scores)
            if choice != "fastest":
                raise
            continue
        models[model.config._attn_implementation] = model
    return models


def compiles(lm, mode: str) -> bool:
    """Whether a CPU worker under `--compile mode` compiles this model's decode step
    (workers/engine/compiled.py `decide`; `on` raises for a model that cannot compile)."""
    from workers.engine.compiled import decide

    return decide(mode, "cpu", False, False, lm.model).enabled


def run_arch(arch: str, args: argparse.Namespace, tmp: Path) -> list[tuple]:
    """Rows (arch, dtype, batch, ours ms, ours eager ms or None, {attention implementation:
    theirs ms}) of one family, its header printed first; ours is the worker's step (compiled
    where `--compile` compiles it), and its eager step beside it when that differs."""
    from workers.device.bind import BoundDevice
    from workers.kernelize.apply import kernelize_for_device
    from workers.model.cpu_projections import install_cpu_projections
    from workers.model.loader import load_model

    cpu = BoundDevice("cpu", 0, "cpu", "cpu", None, 0, False)
    ckpt, what = checkpoint(arch, tmp / arch)
    rows = []
    for dtype in args.dtype:
        lm = load_model(ckpt, dtype=dtype)
        kernelize_for_device(lm.model, cpu)  # the layers a CPU worker runs (workers/main.py)
        install_cpu_projections(lm.model, "cpu", lm.dtype)  # and its packed projections (workers/engine/build.py)
        hfs = hf_models(ckpt, dtype, args.hf_attn)
        compiled = compiles(lm, args.compile)
        if dtype == args.dtype[0]:
            how = "compiled (Inductor)" if compiled else "eager"
            print(f"\n[{arch}] {lm.config.num_parameters / 1e6:.2f}M params, ours {how}, transformers attention "
                  f"{' and '.join(f'`{a}`' for a in hfs)}; {what}", flush=True)
        for batch in args.batch:
            max_len = args.prompt_len + args.steps + 8
            ours = {"ours": Ours(lm, batch, args.prompt_len, max_len, compiled=compiled)}
            if compiled:
                ours["ours eager"] = Ours(lm, batch, args.prompt_len, max_len)
                print(f"  {dtype} batch {batch}: compiled in {ours['ours'].compile_s:.1f} s", flush=True)
            theirs = {impl: Theirs(hf, batch, args.prompt_len) for impl, hf in hfs.items()}
            firsts = {name: o.step() for name, o in ours.items()}
            for impl, t in theirs.items():
                out = t.step()
                diff = max(float((first - out).abs().max()) for first in firsts.values())
                if dtype == "float32" and diff > 1e-3:  # both compute the same model (tests/test_families.py: 1e-4)
                    raise SystemExit(f"[{arch}] batch {batch}: decode logits differ from transformers' ({impl}) "
                                     f"by `{diff:.2e}` (allowed: 1e-3)")
            sides = {**ours, **{f"hf {impl}": t for impl, t in theirs.items()}}
            for _ in range(4):  # warm-up
                for side in sides.values():
                    side.step()
            times = {name: [] for name in sides}
            for _ in range(args.steps):  # one round: ours (compiled, eager), then each of theirs
                for name, side in sides.items():
                    times[name].append(timed(side.step))
            ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
            rows.append((arch, dtype, batch, ms["ours"], ms.get("ours eager"),
                         {impl: ms[f"hf {impl}"] for impl in theirs}))
        del lm, hfs
    return rows


def print_table(rows: list[tuple]) -> None:
    """One line per (arch, dtype, batch): ours (the worker's step), our eager step where it
    compiled, each of transformers' implementations, and the ratios against the faster of them
    (named): the worker's step, then eager's."""
    impls = [i for i in ("sdpa", "eager") if any(i in r[5] for r in rows)]
    impls += sorted({i for r in rows for i in r[5]} - set(impls))
    head = "".join(f"{'hf ' + i + ' ms':>13}" for i in impls)
    print(f"\n{'arch':<11}{'dtype':<10}{'batch':>6}{'ours ms':>10}{'eager ms':>10}{head}{'transformers':>14}"
          f"{'ratio':>8}{'eager':>8}")
    for arch, dtype, batch, ours_ms, eager_ms, theirs in rows:
        best = min(theirs, key=theirs.get)
        cells = "".join(f"{theirs[i]:>13.2f}" if i in theirs else f"{'-':>13}" for i in impls)
        eager_cell = f"{eager_ms:>10.2f}" if eager_ms is not None else f"{'-':>10}"
        eager_ratio = f"{theirs[best] / eager_ms:>7.2f}x" if eager_ms is not None else f"{'-':>8}"
        print(f"{arch:<11}{dtype:<10}{batch:>6}{ours_ms:>10.2f}{eager_cell}{cells}{theirs[best]:>9.2f} {best:<4}"
              f"{theirs[best] / ours_ms:>7.2f}x{eager_ratio}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()  # its progress bars and config notes: not figures
    transformers.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"prompt {args.prompt_len}, {args.steps} rounds")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            rows += run_arch(arch, args, Path(tmp))
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
