"""`benchmarks/vs_vllm.py --matrix`: hetserve against vLLM over models x shapes x concurrencies.

    python benchmarks/vs_vllm.py --matrix     # {embedded, qwen3-100m} x {128/64, 256/32, 1024/128} x {1, 8, 32}
    python benchmarks/vs_vllm.py --matrix --matrix-models embedded --shapes 128/64 --concurrency 1 --rounds 1

Design: vs_vllm.py's servers, client and equal stopping, run once per model: both servers start
once (time to ready recorded for each), then every shape x concurrency cell runs against the pair,
which server goes first alternating from cell to cell, so a cell's two figures are seconds apart.
Trade-off: servers are not restarted per cell, so a cell runs on whatever earlier cells left warm
(caches, compiled graphs), alike for both. The models: the embedded checkpoint and a ~100M-parameter
random Qwen3 that transformers builds (seeded, bfloat16, the embedded tokenizer; made once under
`~/.cache/hetserve/`, never committed). A checkpoint whose context is shorter than the longest
shape is served from a copy whose `max_position_embeddings` covers it (default rotary only: the
same weights and arithmetic). Targets per cell: output tokens/s at least 1.0x vLLM's, median TTFT
no worse than vLLM's; the summary names the cells that miss each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import struct
import sys
import tempfile
from dataclasses import asdict, dataclass
from math import prod
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_vllm as base  # noqa: E402

EMBEDDED = base.ROOT / "workers" / "default_model"
CACHE = Path.home() / ".cache" / "hetserve"
MODELS = ("embedded", "qwen3-100m")
DEFAULT_SHAPES = "128/64,256/32,1024/128"
DEFAULT_CONCURRENCY = [1, 8, 32]
TOK_S_TARGET = 1.0  # hetserve's output tokens/s over vLLM's, at least, in every cell
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SEED = 0
# ~100M parameters (config arithmetic: `qwen3_param_count`), the embedded tokenizer's vocabulary.
QWEN3_100M = {"vocab_size": 4096, "hidden_size": 768, "intermediate_size": 2816, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 4096,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


# -- the matrix's axes -----------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    input_len: int  # prompt tokens
    output_len: int  # new tokens

    def __str__(self) -> str:
        return f"{self.input_len}/{self.output_len}"


def parse_shapes(value: str) -> list[Shape]:
    """`128/64,256/32`: prompt/new tokens, each a positive integer."""
    shapes = []
    for item in value.split(","):
        parts = item.strip().split("/")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"`{item}` is not a shape. Accepted: IN/OUT, prompt and new tokens as positive "
                             "integers, comma-separated (e.g. 128/64,1024/128)")
        shapes.append(Shape(int(parts[0]), int(parts[1])))
    if len(set(shapes)) != len(shapes):
        raise ValueError(f"`{value}` repeats a shape: each must differ")
    return shapes


def parse_models(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",")]
    bad = [n for n in names if n not in MODELS]
    if bad:
        raise ValueError(f"`{bad[0]}` is not a matrix model. Accepted: {', '.join(MODELS)}")
    return list(dict.fromkeys(names))


# -- the models ------------------------------------------------------------------------------


def qwen3_param_count(config: dict) -> int:
    """`Qwen3ForCausalLM`'s parameters for `config` (QWEN3_100M's keys), by arithmetic: nothing allocated."""
    h, head, layers = config["hidden_size"], config["head_dim"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    attention = h * q + 2 * h * kv + q * h + 2 * head  # q, k, v, o; q_norm and k_norm over a head
    if config.get("attention_bias"):
        attention += q + 2 * kv + h
    mlp = 3 * h * config["intermediate_size"]  # gate, up, down
    embeddings = config["vocab_size"] * h * (1 if config["tie_word_embeddings"] else 2)
    return layers * (attention + mlp + 2 * h) + embeddings + h  # two norms a layer; the final norm


def safetensors_params(model: Path) -> int:
    """The parameters a checkpoint stores, from its safetensors headers (no tensor read)."""
    total = 0
    for path in model.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        total += sum(prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def random_qwen3(cache: Path = CACHE) -> Path:
    """The random ~100M Qwen3's directory, made once under `cache` (keyed by its config and seed)."""
    key = hashlib.sha256(json.dumps([QWEN3_100M, SEED, TOKENIZER_FILES], sort_keys=True).encode()).hexdigest()[:12]
    out = cache / f"random-qwen3-100m-{key}"
    if (out / "config.json").exists():
        return out
    vocab = json.loads((EMBEDDED / "config.json").read_text())["vocab_size"]
    if vocab != QWEN3_100M["vocab_size"]:
        raise SystemExit(f"the embedded tokenizer's vocabulary is `{vocab}` tokens, QWEN3_100M's `vocab_size` "
                         f"{QWEN3_100M['vocab_size']}: they must match")
    base.log(f"making a random Qwen3 ({qwen3_param_count(QWEN3_100M) / 1e6:.1f}M parameters) in {out}")
    import torch  # deferred: torch and transformers' model code load only when the checkpoint is made
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_100M)).to(torch.bfloat16)
    cache.mkdir(parents=True, exist_ok=True)
    making = Path(tempfile.mkdtemp(prefix=".making-", dir=cache))  # renamed once complete
    model.save_pretrained(making)
    for name in TOKENIZER_FILES:
        shutil.copy(EMBEDDED / name, making / name)
    _set(making / "tokenizer_config.json", "model_max_length", QWEN3_100M["max_position_embeddings"])
    making.rename(out)
    return out


def with_context(model: Path, context: int, copy_to: Path) -> tuple[Path, str]:
    """`model`, or a copy at `copy_to` whose context is `context` where `model`'s is shorter; and why."""
    config = json.loads((model / "config.json").read_text())
    own = int(config.get("max_position_embeddings", 0))
    if own >= context:
        return model, ""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise SystemExit(f"`{model}` has context {own} < {context} and rotary `{rope}`: only a default "
                         "rotary serves longer unchanged. Accepted: shorter --shapes")
    copy_to.mkdir(parents=True, exist_ok=True)
    for path in [*model.glob("*.json"), *model.glob("*.safetensors")]:
        shutil.copy(path, copy_to / path.name)
    _set(copy_to / "config.json", "max_position_embeddings", context)
    if (copy_to / "tokenizer_config.json").exists():
        _set(copy_to / "tokenizer_config.json", "model_max_length", context)
    return copy_to, f"context {own} < {context}: served from a copy whose max_position_embeddings is {context}"


def _set(path: Path, key: str, value) -> None:
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data, indent=2) + "\n")


# -- cells and targets -----------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    model: str
    shape: Shape
    concurrency: int
    hetserve: dict  # vs_vllm.summary's fields, each the median over the rounds
    vllm: dict
    ratio: float  # hetserve's output tokens/s over vLLM's: the median of the rounds' ratios

    @property
    def name(self) -> str:
        return f"{self.model} {self.shape} c{self.concurrency}"


def cell(model: str, shape: Shape, concurrency: int, mine: list[dict], theirs: list[dict]) -> Cell:
    """A cell from its rounds' summaries (hetserve's, vLLM's; round by round)."""
    def medians(runs: list[dict]) -> dict:
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    ratio = statistics.median(h["output_tok_s"] / v["output_tok_s"] for h, v in zip(mine, theirs, strict=True))
    return Cell(model, shape, concurrency, medians(mine), medians(theirs), ratio)


def misses(c: Cell) -> dict[str, str]:
    """The targets `c` misses, each with its figures: {"tok/s": ..., "TTFT": ...}; empty where both are met."""
    out = {}
    if c.ratio < TOK_S_TARGET:
        out["tok/s"] = f"{c.ratio:.2f}x"
    if c.hetserve["ttft_ms"] > c.vllm["ttft_ms"]:
        out["TTFT"] = f"{c.hetserve['ttft_ms']:.1f} vs {c.vllm['ttft_ms']:.1f} ms"
    return out


def verdict_lines(cells: list[Cell]) -> list[str]:
    """One line per target: met in every cell, or the cells that miss it."""
    lines = []
    for target, wants in (("tok/s", f"output tokens/s >= {TOK_S_TARGET:.1f}x vLLM's"),
                          ("TTFT", "median TTFT <= vLLM's")):
        missed = [f"{c.name} ({misses(c)[target]})" for c in cells if target in misses(c)]
        lines.append(f"{wants}: " + (f"missed in {len(missed)} of {len(cells)} cells: {'; '.join(missed)}"
                                     if missed else f"met in every cell ({len(cells)})"))
    unequal = [c.name for c in cells if not equal_tokens(c)]
    if unequal:
        lines.append(f"token counts differ from prompts x new tokens in: {'; '.join(unequal)}")
    return lines


def equal_tokens(c: Cell) -> bool:
    return c.hetserve["output_tokens"] == c.vllm["output_tokens"] == c.hetserve["expected_tokens"]


# -- the run ---------------------------------------------------------------------------------


def run_model(name: str, model: Path, vllm: Path, variant: str, shapes: list[Shape], concurrency: list[int],
              args: argparse.Namespace, scratch: Path, max_len: int) -> tuple[list[Cell], dict, str]:
    """One pair of servers on `model`, every cell against it; the cells, each server's time to ready, the stopping."""
    kinds = ["vllm", variant]
    servers: dict[str, base.Server] = {}
    runs = {(s, c): {kind: [] for kind in kinds} for s in shapes for c in concurrency}
    try:
        for i, kind in enumerate(kinds):  # both up before either is measured
            servers[kind] = base.start(kind, vllm, model, args.port + 1 + i, scratch, max_len)
        stopping, how = base.stopping_for(servers[variant].url, model)
        for r in range(args.rounds):
            for turn, (s, c) in enumerate(runs, start=r):  # which server goes first alternates
                shaped = argparse.Namespace(**{**vars(args), "input_len": s.input_len, "output_len": s.output_len,
                                               "seed": args.seed + 100_000 * r + 1000 * shapes.index(s) + c})
                for kind in (kinds if turn % 2 == 0 else kinds[::-1]):
                    base.log(f"{name} {s} c{c}, round {r + 1}: {servers[kind].name}")
                    runs[s, c][kind].append(base.summary(base.bench(vllm, servers[kind], model, c, shaped, stopping,
                                                                    scratch)))
    finally:
        for server in servers.values():
            server.stop()
    cells = [cell(name, s, c, got[variant], got["vllm"]) for (s, c), got in runs.items()]
    ready = {"hetserve": round(servers[variant].ready_s, 1), "vllm": round(servers["vllm"].ready_s, 1)}
    return cells, ready, how


def print_matrix(cells: list[Cell], models: dict, rounds: int) -> None:
    print(f"vllm bench serve, random prompts, greedy; medians over {rounds} round(s); hetserve / vLLM")
    for name, m in models.items():
        print(f"{name}: {m['params'] / 1e6:.1f}M parameters; time to ready {m['ready_s']['hetserve']:.1f} / "
              f"{m['ready_s']['vllm']:.1f} s; stopping: {m['stopping']}" + (f"; {m['note']}" if m["note"] else ""))
    print(f"{'model':<11} {'in/out':>8} {'conc':>4} | {'tok/s':>6} {'vLLM':>6} {'ratio':>6} | {'TTFT ms':>8} "
          f"{'vLLM':>8} | {'TPOT ms':>7} {'vLLM':>7} | tokens")
    for c in cells:
        h, v = c.hetserve, c.vllm
        print(f"{c.model:<11} {str(c.shape):>8} {c.concurrency:>4} | {h['output_tok_s']:>6.0f} "
              f"{v['output_tok_s']:>6.0f} {c.ratio:>5.2f}x | {h['ttft_ms']:>8.1f} {v['ttft_ms']:>8.1f} | "
              f"{h['tpot_ms']:>7.2f} {v['tpot_ms']:>7.2f} | {'equal' if equal_tokens(c) else 'DIFFER'}")
    for line in verdict_lines(cells):
        print(line)


def run(args: argparse.Namespace) -> int:
    """vs_vllm.py's main with `--matrix`."""
    try:
        shapes = parse_shapes(args.shapes or DEFAULT_SHAPES)
        names = parse_models(args.matrix_models or ",".join(MODELS))
    except ValueError as e:
        raise SystemExit(f"vs_vllm.py --matrix: {e}") from None
    concurrency = args.concurrency or DEFAULT_CONCURRENCY
    variants = base.hetserve_variants(args)
    if args.no_vllm or len(variants) != 1:
        raise SystemExit("--matrix compares vLLM with one hetserve: no --no-vllm, at most one --serve-args/--compile")
    vllm = base.ensure_venv(args.venv)
    scratch = Path(tempfile.mkdtemp(prefix="hetserve-vs-vllm-matrix-"))
    max_len = base.max_model_len(max(s.input_len + s.output_len for s in shapes))
    cells: list[Cell] = []
    models: dict[str, dict] = {}
    for name in names:
        source = EMBEDDED if name == "embedded" else random_qwen3()
        model, note = with_context(source, max_len, scratch / f"{name}-context-{max_len}")
        params = safetensors_params(model)
        base.log(f"{name}: {model}, {params / 1e6:.1f}M parameters" + (f"; {note}" if note else ""))
        (scratch / name).mkdir()
        got, ready, how = run_model(name, model, vllm, variants[0], shapes, concurrency, args, scratch / name, max_len)
        cells += got
        models[name] = {"path": str(model), "params": params, "note": note, "ready_s": ready, "stopping": how}
    if args.json:
        print(json.dumps({"models": models, "max_model_len": max_len, "rounds": args.rounds,
                          "cells": [{**asdict(c), "shape": str(c.shape), "misses": misses(c)} for c in cells],
                          "verdicts": verdict_lines(cells)}, indent=2))
    else:
        print_matrix(cells, models, args.rounds)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0
