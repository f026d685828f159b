"""hetserve against llama.cpp's own server on one GGUF file, measured by vLLM's client, side by side.

    python benchmarks/gguf.py                       # a ~100M-parameter Llama as Q4_K_M, concurrency 1 and 8
    python benchmarks/gguf.py --rounds 2 --concurrency 1 8 --hidden 1024 --layers 8

What it does, in order:
1. a random Llama of `--hidden` x `--layers` (tests/gguf_checkpoints.py's writer: gguf-py's
   `GGUFWriter`, laid out as llama.cpp's converter lays it out, the embedded model's tokenizer),
   written as F32 and quantized to `--ftype` (Q4_K_M by default) by llama.cpp's own quantizer,
   once, under `~/.cache/hetserve/bench-gguf/` (a model where compute matters: the 4M embedded one
   would time Python, not matrix work);
2. llama.cpp's server (`llama_cpp.server` of llama-cpp-python, built from source once into its own
   venv: scripts/llama_cpp_fixtures.py) and `hetserve serve --model FILE.gguf`, both at once on
   their own ports, llama.cpp computing with `--threads` threads (default: the host's cores),
   hetserve with each of `--hetserve-threads` (default: its own choice; `default 2`: two servers,
   measured in the same rounds, the order of all servers rotating) and each of
   `--hetserve-activations` (`exact int8`: a server each way, `--gguf-activations int8` rounding a
   decode's activations to 8 bits as llama.cpp does);
3. per round and concurrency, `vllm bench serve` (vLLM's client, from benchmarks/vs_vllm.py's venv)
   with random prompts of `--input-len` tokens and `--output-len` greedy ones, every special token
   banned on both by a logit bias (llama.cpp also stops on a template's end tokens) so both produce
   every token, against one server, then the other (the order alternates); llama.cpp's server
   queues concurrent requests (`--interrupt_requests False`: by default a new request cuts the
   running one off);
4. prints output tokens/s, median TTFT and TPOT of both and the ratios against the targets (at
   least 0.8x llama.cpp's output tokens/s at concurrency 1, at least 1x at 8), and what hetserve's
   worker says of the file: how its layers run on this device and why, and its resident bytes
   against the packed ones and the bf16 ones.
Never in CI (it builds llama.cpp and installs vLLM's client).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# this file's own directory off the path: `import gguf` (gguf-py) must not find this script
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def _vs_vllm():
    """benchmarks/vs_vllm.py, loaded by its path (its directory is not on the path: see above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vs_vllm", ROOT / "benchmarks" / "vs_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_V = _vs_vllm()
DEFAULT_VENV, Server, ensure_venv, log, summary = _V.DEFAULT_VENV, _V.Server, _V.ensure_venv, _V.log, _V.summary

CACHE = Path.home() / ".cache" / "hetserve" / "bench-gguf"
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "IQ4_XS": 30}
SERVER_EXTRAS = ("fastapi", "uvicorn", "sse-starlette", "starlette-context", "pydantic-settings")
NAME = "bench-gguf"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ftype", default="Q4_K_M", choices=sorted(FTYPES))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=0, help="0: 8 per unit of concurrency, at least 16")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="llama.cpp's compute threads (`--n_threads`)")
    p.add_argument("--hetserve-threads", nargs="+", default=["default"],
                   help="hetserve's `--threads`, one server each, all in the same rounds (`default`: its own "
                        "choice; e.g. `default 2`)")
    p.add_argument("--hetserve-activations", nargs="+", default=["exact"], choices=["exact", "int8"],
                   help="hetserve's `--gguf-activations`, one server each (with each `--hetserve-threads`), all in the "
                        "same rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vLLM's venv (its client)")
    return p.parse_args(argv)


def model_file(hidden: int, layers: int, ftype: str) -> Path:
    """The benchmark's GGUF, written and quantized once."""
    from llama_cpp_fixtures import _QUANTIZE, llama_cpp_python

    path = CACHE / f"llama-h{hidden}-l{layers}-{ftype}.gguf"
    if path.exists():
        return path
    from tests.gguf_checkpoints import make_gguf

    CACHE.mkdir(parents=True, exist_ok=True)
    heads = hidden // 64
    options = dict(hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 256 * 256, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
                   max_position_embeddings=2048, initializer_range=0.02)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        log(f"writing a random Llama ({options}) as F32, then {ftype} by llama.cpp's quantizer")
        source = make_gguf("llama", "F32", Path(tmp), options=options)
        subprocess.run([llama_cpp_python(), "-c", _QUANTIZE, str(source), str(path), str(FTYPES[ftype])], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


# llama-cpp-python's server, its request-id check off: vLLM's client sends `x-request-id` values that
# are not UUIDs, which that check answers with 400 and an empty body
_LLAMA_SERVER = """
import sys
import llama_cpp.server.app as app
from starlette_context.plugins import RequestIdPlugin
app.RequestIdPlugin = lambda: RequestIdPlugin(validate=False)
from llama_cpp.server.__main__ import main
sys.argv[0] = "llama_cpp.server"
main()
"""


def llama_cpp_server(model: Path, port: int, log_dir: Path, threads: int, max_len: int) -> Server:
    from llama_cpp_fixtures import llama_cpp_python

    python = llama_cpp_python()
    if subprocess.run([python, "-c", "import llama_cpp.server.app, sse_starlette, starlette_context"],
                      capture_output=True).returncode != 0:
        subprocess.run([python, "-m", "pip", "install", "-q", *SERVER_EXTRAS], check=True)
    cmd = [str(python), "-c", _LLAMA_SERVER, "--model", str(model), "--model_alias", NAME, "--host",
           "127.0.0.1", "--port", str(port), "--n_ctx", str(max_len), "--n_threads", str(threads),
           "--n_threads_batch", str(threads), "--interrupt_requests", "False"]  # queued, not cut off
    return Server("llama.cpp", cmd, port, dict(os.environ), log_dir, "/v1/models")


def hetserve_name(threads: str, activations: str = "exact") -> str:
    return ("hetserve" + ("" if threads == "default" else f"-t{threads}") +
            ("" if activations == "exact" else f"-{activations}"))


def hetserve(model: Path, port: int, log_dir: Path, threads: str, activations: str = "exact") -> Server:
    """One CPU worker, computing with `threads` threads ("default": hetserve's own choice), its GGUF
    GEMV's activations `activations` (`--gguf-activations`)."""
    if threads != "default" and not (threads.isdigit() and int(threads) > 0):
        raise SystemExit(f"--hetserve-threads: `default` or a positive count expected, got {threads!r}")
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--served-model-name", NAME,
           "--host", "127.0.0.1", "--port", str(port), "--gguf-activations", activations,
           *(() if threads == "default" else ("--threads", threads))]
    env = {k: v for k, v in os.environ.items() if k not in ("HETSERVE_WORKER_CMD", "HETSERVE_COMPILE")}
    return Server(hetserve_name(threads, activations), cmd, port, env, log_dir, "/health", compiles_behind=True)


def bench(vllm: Path, server: Server, tokenizer: Path, concurrency: int, args, banned: list[int],
          out_dir: Path) -> dict:
    """vs_vllm's client run against the served name, with the file's tokenizer and `banned` token ids."""
    stopping = ["--extra-body", json.dumps({"logit_bias": {str(t): -100 for t in banned}})]
    return _V.bench(vllm, server, NAME, concurrency, args, stopping, out_dir, ["--tokenizer", str(tokenizer)])


def worker_gguf(url: str) -> dict:
    with urllib.request.urlopen(url + "/workers", timeout=10) as r:
        worker = json.loads(r.read())["workers"][0]
    return (worker.get("model") or {}).get("gguf") or {}


def main(argv=None) -> int:
    args = parse_args(argv)
    vllm = ensure_venv(args.venv)
    model = model_file(args.hidden, args.layers, args.ftype)
    from workers.gguf.prepare import prepare

    tokenizer = prepare(model, CACHE / "prepared")
    # every special token banned: llama.cpp also ends a sequence on the template's end tokens
    specials = [a["id"] for a in json.loads((tokenizer / "tokenizer.json").read_text())["added_tokens"]
                if a["special"]]
    max_len = max(512, args.input_len + args.output_len + 64)
    variants = [(t, a) for t in args.hetserve_threads for a in args.hetserve_activations]
    names = ["llama.cpp", *(hetserve_name(t, a) for t, a in variants)]
    rows: dict[int, dict[str, list[dict]]] = {c: {n: [] for n in names} for c in args.concurrency}
    with tempfile.TemporaryDirectory(prefix="bench-gguf-") as tmp:
        out = Path(tmp)
        servers = {}
        try:
            servers["llama.cpp"] = llama_cpp_server(model, 8701, out, args.threads, max_len)
            for i, (threads, activations) in enumerate(variants):
                servers[hetserve_name(threads, activations)] = hetserve(model, 8702 + i, out, threads, activations)
            described = worker_gguf(servers[names[1]].url)
            for r in range(args.rounds):
                for c in args.concurrency:
                    # the order rotates per round and concurrency: none is always first or last
                    shift = (r + args.concurrency.index(c)) % len(names)
                    order = names[shift:] + names[:shift]
                    # prompts of their own per round and concurrency (the same for both servers): a prompt seen
                    # before would hit a server's prefix cache and time a prefill that did not happen
                    fresh = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * r + c})
                    for name in order:
                        rows[c][name].append(summary(bench(vllm, servers[name], tokenizer, c, fresh, specials, out)))
                        log(f"round {r + 1} c={c} {name}: {rows[c][name][-1]}")
        finally:
            for s in servers.values():
                s.stop()
    print(f"{model.name} ({model.stat().st_size} bytes), {args.input_len} prompt / {args.output_len} new tokens, "
          f"llama.cpp {args.threads} threads, hetserve --threads {' / '.join(args.hetserve_threads)} and "
          f"--gguf-activations {' / '.join(args.hetserve_activations)}, "
          f"{args.rounds} round(s), medians over rounds")
    print("| concurrency | hetserve | llama.cpp tok/s | hetserve tok/s | ratio | target | "
          "TTFT ms (llama.cpp / hetserve) | TPOT ms (llama.cpp / hetserve) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in args.concurrency:
        med = {n: {k: statistics.median(x[k] for x in rows[c][n]) for k in ("output_tok_s", "ttft_ms", "tpot_ms")}
               for n in rows[c]}
        base = med["llama.cpp"]
        for name in names[1:]:
            short = [x for n in ("llama.cpp", name) for x in rows[c][n] if x["output_tokens"] != x["expected_tokens"]]
            ratio = med[name]["output_tok_s"] / (base["output_tok_s"] or float("nan"))
            print(f"| {c} | {name} | {base['output_tok_s']:.1f} | {med[name]['output_tok_s']:.1f} | {ratio:.2f}x | "
                  f"{'>= 0.8x' if c == 1 else '>= 1x'} | {base['ttft_ms']:.0f} / {med[name]['ttft_ms']:.0f} | "
                  f"{base['tpot_ms']:.1f} / {med[name]['tpot_ms']:.1f} |"
                  + (f" ({len(short)} runs with fewer tokens than asked)" if short else ""))
    if described:
        print(f"hetserve's worker: {described.get('execution')}: {described.get('reason')}")
        print(f"types {described.get('types')}; packed bytes {described.get('packed_bytes')}, resident "
              f"{described.get('resident_bytes')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
