"""LoRA adapters over HTTP: hetserve against vLLM's CPU build with `--enable-lora`, on the same adapters.

    python benchmarks/lora_vs_vllm.py                 # the embedded model, 8 adapters, concurrency 32
    python benchmarks/lora_vs_vllm.py --rounds 3 --concurrency 8

Design: PEFT writes `--adapters` adapters over the checkpoint (benchmarks/lora.py `write_adapters`:
random A and B, rank `--rank`, q/k/v/o/gate/up/down). Both servers serve the checkpoint in bfloat16
with every adapter loaded at start and `--max-loras` equal to their number: `hetserve serve --lora
NAME=DIR ...` and `vllm serve --enable-lora --lora-modules NAME=DIR ...` (vs_vllm.py's server and
venv), both at once. Each round runs vLLM's own client, `vllm bench serve --dataset-name random`
(greedy, EOS ignored, every token counted), twice per server: on the base model, then with
`--lora-modules` naming every adapter, assigned round-robin so each concurrent batch mixes them; the
server that goes first alternates by round. Prints, per server, the median output tokens/s on the
base and with the adapters, the adapters' ratio to the base (the median of each round's), and
hetserve's over vLLM's for each case, with median TTFT and TPOT. Trade-off: HTTP, tokenization and
the client are in the figures (benchmarks/lora.py measures the engine alone); on a 2-core machine
the client shares the cores with the server it measures, alike for both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import vs_vllm  # noqa: E402  (benchmarks/ on the path first)
from lora import write_adapters  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "workers" / "default_model", help="HF-layout checkpoint dir")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=None, help="default 4 x concurrency")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8700)
    p.add_argument("--venv", type=Path, default=vs_vllm.DEFAULT_VENV, help="vLLM's venv, made if missing")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def served_name(url: str) -> str:
    """The base model's id as the server lists it (with adapters served, hetserve takes no other name)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        models = json.loads(r.read())["data"]
    return next(m["id"] for m in models if not m.get("parent"))


def servers(vllm: Path, model: Path, adapters: list[tuple[str, Path]], args, tmp: Path) -> dict[str, vs_vllm.Server]:
    """hetserve and vLLM, each serving `adapters` over `model`, both up before either is measured."""
    count, rank = str(len(adapters)), str(max(16, args.rank))
    het = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--dtype", "bfloat16",
           "--host", "127.0.0.1", "--port", str(args.port), "--max-loras", count, "--max-lora-rank", rank,
           *(a for name, path in adapters for a in ("--lora", f"{name}={path}"))]
    env = {k: v for k, v in os.environ.items() if k not in ("HETSERVE_WORKER_CMD", "HETSERVE_COMPILE")}
    up = {"hetserve": vs_vllm.Server("hetserve", het, args.port, env, tmp, "/health", compiles_behind=True)}
    try:
        lora = ["--enable-lora", "--max-loras", count, "--max-lora-rank", rank, "--lora-modules",
                *(f"{name}={path}" for name, path in adapters)]
        max_len = vs_vllm.max_model_len(args.input_len + args.output_len)
        up["vllm"] = vs_vllm.vllm_server(vllm, model, args.port + 1, tmp, max_len, lora)
    except BaseException:
        up["hetserve"].stop()
        raise
    return up


def main(argv=None) -> int:
    args = parse_args(argv)
    args.num_prompts = args.num_prompts or 4 * args.concurrency
    vllm = vs_vllm.ensure_venv(args.venv)
    model = args.model.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="hetserve-lora-vs-vllm-"))
    adapters = write_adapters(model, tmp / "adapters", args.adapters, args.rank)
    names = [name for name, _ in adapters]
    up = servers(vllm, model, adapters, args, tmp)
    cases = {"base": [], "adapters": ["--lora-modules", *names, "--lora-assignment", "round-robin"]}
    results: dict[str, dict[str, list[dict]]] = {kind: {case: [] for case in cases} for kind in up}
    try:
        stopping, how = vs_vllm.stopping_for(up["hetserve"].url, model)
        names_for = {kind: ["--served-model-name", served_name(s.url)] for kind, s in up.items()}
        for r in range(args.rounds):
            for kind in (list(up) if r % 2 == 0 else list(up)[::-1]):
                for case, extra in cases.items():
                    got = vs_vllm.bench(vllm, up[kind], model, args.concurrency, args, stopping, tmp,
                                        [*names_for[kind], *extra])
                    summary = vs_vllm.summary(got)
                    if summary["output_tokens"] != summary["expected_tokens"] or summary["failed"]:
                        raise RuntimeError(f"{kind} {case}: {summary['output_tokens']} tokens of "
                                           f"{summary['expected_tokens']}, {summary['failed']} failed")
                    results[kind][case].append(summary)
            vs_vllm.log(f"round {r + 1}: " + ", ".join(f"{k} {c} {v[c][-1]['output_tok_s']:.0f} tok/s"
                                                      for k, v in results.items() for c in cases))
    finally:
        for server in up.values():
            server.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps({"stopping": how, "results": results}, indent=2))
        return 0
    print(f"\n{model.name} bfloat16, {len(names)} adapters of rank {args.rank} (q/k/v/o/gate/up/down), "
          f"--max-loras {len(names)}, concurrency {args.concurrency}, {args.num_prompts} prompts of "
          f"{args.input_len} + {args.output_len} tokens, {how}, {args.rounds} rounds (medians):")
    med = {k: {c: {f: statistics.median(x[f] for x in runs) for f in ("output_tok_s", "ttft_ms", "tpot_ms")}
               for c, runs in v.items()} for k, v in results.items()}
    for kind, by_case in results.items():
        ratio = statistics.median(a["output_tok_s"] / b["output_tok_s"]
                                  for a, b in zip(by_case["adapters"], by_case["base"], strict=True))
        print(f"  {kind:<9} base {med[kind]['base']['output_tok_s']:7.1f} tok/s, adapters "
              f"{med[kind]['adapters']['output_tok_s']:7.1f} tok/s: {ratio:.2f}x its base "
              f"(TTFT {med[kind]['adapters']['ttft_ms']:.1f} ms, TPOT {med[kind]['adapters']['tpot_ms']:.2f} ms)")
    for case in cases:
        ratio = statistics.median(a["output_tok_s"] / b["output_tok_s"]
                                  for a, b in zip(results["hetserve"][case], results["vllm"][case], strict=True))
        print(f"  hetserve / vLLM, {case}: {ratio:.2f}x output tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
