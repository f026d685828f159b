"""A new user's first start, then a second one: time to the first answer and to the compiled step.

    .venv/bin/python benchmarks/first_start.py [--model DIR] [--dtype bfloat16] [--extensions DIR]

`hetserve serve` on this machine's CPU (the embedded model unless `--model`), twice with one set of
fresh cache directories (C++ extensions, Triton and Inductor): the first start finds them empty,
the second warm. Each run prints the seconds from spawn until the first answer to a one-token
`/generate`, and until `/workers` says no decode step is still compiling (the worker serves eager
meanwhile under `--compile auto`), and the longest the engine's steps waited on the compile of
one bucket (`/workers` `compile.held_max_s`). `--extensions DIR` keeps an existing C++ extension
cache (the Triton and Inductor caches stay fresh), to time the decode step's compile alone.
Trade-off: a cold start builds every C++ kernel and compiles the decode step, minutes of the
machine's time, so this runs by hand, not in the suite.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None) -> dict | None:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def one_start(caches: Path, model: str | None, dtype: str, log: Path,
              extensions: Path | None = None, timeout: float = TIMEOUT_S) -> tuple[float, float, float, str]:
    """(seconds to the first answer, seconds until no decode step compiles, the longest the steps
    waited on the compile of one bucket, how many buckets the worker found compiled) of one start."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSERVE_")}
    env = {k: v for k, v in env.items() if not k.startswith("TORCHINDUCTOR")}
    env.update(TORCH_EXTENSIONS_DIR=str(extensions or caches / "torch_extensions"),
               HETSERVE_TRITON_CACHE=str(caches / "triton"))
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    if model:
        cmd += ["--model", model]
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        first = compiled = None
        while time.monotonic() - t0 < timeout and proc.poll() is None:
            if first is None and _get(url + "/generate", {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}):
                first = time.monotonic() - t0
            if first is not None:
                workers = (_get(url + "/workers") or {}).get("workers") or []
                if workers and all((w.get("compile") or {}).get("state") != "compiling" for w in workers):
                    compiled = time.monotonic() - t0
                    held = max((w.get("compile") or {}).get("held_max_s") or 0.0 for w in workers)
                    hits = sum((w.get("compile") or {}).get("cache_hits") or 0 for w in workers)
                    buckets = sum(len((w.get("compile") or {}).get("buckets") or ()) for w in workers)
                    break
            time.sleep(0.5)
        if first is None or compiled is None:
            raise RuntimeError(f"the server did not answer and settle within {timeout:.0f} s; its log: {log}")
        return first, compiled, held, f"{hits} of {buckets} buckets found in the Inductor cache"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--extensions", type=Path, default=None,
                        help="an existing C++ extension cache to keep (default: a fresh one)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds each start may take")
    args = parser.parse_args(argv)
    if args.extensions is not None and not args.extensions.is_dir():
        parser.error(f"`--extensions {args.extensions}` is not a directory. Accepted: an existing "
                     "TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions)")
    caches = Path(tempfile.mkdtemp(prefix="hetserve-first-start-"))
    try:
        for name in ("empty caches", "warm caches"):
            first, compiled, held, hits = one_start(caches, args.model, args.dtype, caches / f"{name.split()[0]}.log",
                                              args.extensions, args.timeout)
            print(f"{name}: first answer {first:.1f} s after spawn, decode step compiled {compiled:.1f} s after spawn, "
                  f"steps held at most {held:.1f} s by the compile ({hits})", flush=True)
    except RuntimeError:
        for log in sorted(caches.glob("*.log")):  # the server's own words, before its directory goes
            print(f"--- the last lines of {log.name}:", *log.read_text(errors="replace").splitlines()[-30:], sep="\n")
        raise
    finally:
        shutil.rmtree(caches, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
