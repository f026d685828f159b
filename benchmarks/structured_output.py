"""What structured output costs: json_schema-constrained chat requests vs unconstrained ones.

    python benchmarks/structured_output.py [--model DIR] [--concurrency 8] [--tokens 64] [--rounds 9]

Starts `hetserve serve` (one worker, the embedded model unless `--model`), then alternates
rounds of `--concurrency` concurrent `/v1/chat/completions` requests, all unconstrained or all
with a `response_format` json_schema (a list of records with strings, bounded integers and
enums: structure in every few tokens), and prints the time per generated token of each side
(round wall time / tokens generated) and their ratio (target <= 1.3x). Each side's figure is
its best round (the machines are shared: a round that another process slowed says nothing
about the grammar); the medians are printed beside them.
Then the same comparison inside one process, straight through the engine (no HTTP, no
router): the grammar's own cost, without the noise of the serving path.
Both sides sample from the full distribution (temperature 1, top_p 1, top_k off, one seed
per request) and carry the same `logit_bias` against EOS, so every request makes exactly
`--tokens` tokens and the only difference is the grammar (the schema asks for more items
than fit, so the constraint is active to the last token). Top_k / top_p stay off because
their sort runs about 2.5x faster on a masked row (mostly -inf) and would flatter the
constrained side. One warm-up round per side runs before timing: it compiles the schema (as a
server's cache then holds it) and lets llguidance cache the lexer states its masks visit
(the first round of a new schema computes masks about 2-3x slower). The grammar masks are
computed on the engine's helper thread while the forward runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.router_harness import RouterProcess  # noqa: E402
from workers.contract import DEFAULT_MODEL_DIR, read_tokenizer_config, token_text  # noqa: E402

RECORDS = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 40, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10},
                       "age": {"type": "integer", "minimum": 0, "maximum": 99},
                       "mood": {"enum": ["happy", "sad", "wise"]}},
        "required": ["name", "age", "mood"], "additionalProperties": False}}},
    "required": ["people"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "people", "schema": RECORDS, "strict": True}}


def summary(per_token: dict[str, list[float]]) -> dict:
    best = {k: min(v) for k, v in per_token.items()}
    median = {k: statistics.median(v) for k, v in per_token.items()}
    return {"ms_per_token": best, "median_ms_per_token": median, "rounds": per_token,
            "ratio": best["json_schema"] / best["unconstrained"],
            "median_ratio": median["json_schema"] / median["unconstrained"]}


async def round_(client: httpx.AsyncClient, n: int, tokens: int, eos: int, constrained: bool,
                 seed: int) -> tuple[float, int]:
    """(wall seconds, tokens generated) for `n` concurrent requests."""
    def body(i: int) -> dict:
        b = {"messages": [{"role": "user", "content": f"List people, please ({i})."}], "max_tokens": tokens,
             "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": seed + i, "logit_bias": {str(eos): -100}}
        return {**b, "response_format": FORMAT} if constrained else b

    t0 = time.perf_counter()
    replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=body(i)) for i in range(n)))
    wall = time.perf_counter() - t0
    for r in replies:
        r.raise_for_status()
    return wall, sum(r.json()["usage"]["completion_tokens"] for r in replies)


async def measure(url: str, n: int, tokens: int, rounds: int, eos: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await round_(client, n, tokens, eos, True, 0)  # warm-up: compiles the schema, fills caches
        await round_(client, n, tokens, eos, False, 0)
        per_token: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
        for r in range(rounds):
            order = (False, True) if r % 2 == 0 else (True, False)  # alternate, so noise hits both sides
            for constrained in order:
                name = "json_schema" if constrained else "unconstrained"
                wall, made = await round_(client, n, tokens, eos, constrained, 1000 * r)
                per_token[name].append(1000 * wall / made)
    return summary(per_token)


def engine_rounds(model_dir: Path, n: int, tokens: int, rounds: int, eos: int) -> dict:
    """The same comparison through the engine in this process (the worker's code, no HTTP)."""
    import torch

    from workers.engine.core import Engine
    from workers.engine.runner import ModelRunner
    from workers.engine.scheduler import Scheduler, SchedulerConfig
    from workers.model.loader import load_model
    from workers.sampling.grammar import Grammars, GrammarSpec, json_text
    from workers.sampling.params import SamplingParams

    torch.set_num_threads(1)
    loaded = load_model(model_dir, "auto", torch.device("cpu"), None)
    grammars = Grammars.for_tokenizer(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids)
    spec = GrammarSpec("json_schema", json_text(RECORDS))
    prompt = loaded.tokenizer.encode("List people, please.").ids

    def one(constrained: bool, seed: int) -> float:
        config = SchedulerConfig(n, len(prompt) + tokens + 1, eos_token_ids=loaded.eos_token_ids)  # blocks for n
        kv = loaded.model.new_kv_pool(config.num_blocks, config.block_size)
        engine = Engine(ModelRunner(loaded.model, kv, "cpu"), Scheduler(config), loaded.tokenizer, grammars=grammars)
        for i in range(n):
            params = SamplingParams.create(max_new_tokens=tokens, temperature=1.0, seed=seed + i,
                                           logit_bias={eos: -100}, grammar=spec if constrained else None)
            engine.submit(prompt, params, grammar=grammars.compile(spec) if constrained else None)
        t0 = time.perf_counter()
        while engine.step():
            pass
        return 1000 * (time.perf_counter() - t0) / (n * tokens)

    one(True, 0)  # warm-up, as above
    one(False, 0)
    per_token: dict[str, list[float]] = {"unconstrained": [], "json_schema": []}
    for r in range(rounds):
        for constrained in ((False, True) if r % 2 == 0 else (True, False)):
            per_token["json_schema" if constrained else "unconstrained"].append(one(constrained, 1000 * r))
    return summary(per_token)


def eos_id(model_dir: Path) -> int:
    """The model's EOS token id (from its tokenizer files), which both sides bias against."""
    from tokenizers import Tokenizer

    eos = token_text(read_tokenizer_config(model_dir).get("eos_token"))
    found = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(eos) if eos else None
    if found is None:
        raise SystemExit(f"no EOS token found in `{model_dir}` (tokenizer_config.json `eos_token`)")
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model directory (default: the embedded model)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", action="store_true", help="print the raw result as JSON")
    args = p.parse_args()
    serve = ["--max-batch", str(max(8, args.concurrency))] + (["--model", args.model] if args.model else [])
    model_dir = Path(args.model) if args.model else DEFAULT_MODEL_DIR
    eos = eos_id(model_dir)
    router = RouterProcess(serve, fake=False, ready_timeout=300)
    try:
        info = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"][0]
        served = asyncio.run(measure(router.url, args.concurrency, args.tokens, args.rounds, eos))
    finally:
        router.stop()
    engine = engine_rounds(model_dir, args.concurrency, args.tokens, args.rounds, eos)
    if args.json:
        print(json.dumps({"served": served, "engine": engine}, indent=2))
        return 0
    print(f"{args.concurrency} concurrent requests x {args.tokens} tokens, {args.rounds} rounds per side")
    ok = True
    for title, result in ((f"chat requests through `hetserve serve` (worker {info['id']})", served),
                          ("the engine in this process, one thread", engine)):
        best, med = result["ms_per_token"], result["median_ms_per_token"]
        print(f"  {title}: best round (median)")
        for name in ("unconstrained", "json_schema"):
            print(f"    {name:14} {best[name]:7.3f} ms/token ({med[name]:.3f})")
        ok &= result["ratio"] <= 1.3
        print(f"    json_schema / unconstrained: {result['ratio']:.3f}x ({result['median_ratio']:.3f}x)")
    print(f"  target <= 1.3x: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
