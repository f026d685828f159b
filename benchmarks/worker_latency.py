"""What the worker adds to a request: a one-token generation over its engine channel and over its
HTTP socket vs the bare prefill + argmax of the same prompt, side by side in one run.

    python benchmarks/worker_latency.py [--simulate sm_90] [--requests 300] [--threads 1]

Starts `python -m workers` (the embedded model, `--threads 1`) and, in this process, the same
model in the same dtype. Then alternates, request by request: one `Submit` with the prompt's
token ids and `max_new_tokens: 1` on the engine channel (workers/contract/channel.py: what the
router sends), until the stream's last record; one `/generate` on the HTTP socket (a raw
keep-alive HTTP/1.1 client); and one bare `model.step` prefill of the same token ids + argmax.
Both clients cost a few microseconds, so the figures are the worker's. Prints p50 / p99 of each
and the difference to the bare step, the worker's added latency (target: p50 <= 1 ms on the
channel, the router's path), and the CPU time each costs per request (the worker process's
user + system time around its calls, and this thread's for the bare step), which stays
meaningful when other processes make wall times noisy. `--profile FILE` also records the
serving worker with `py-spy` (which must be installed) into FILE as collapsed stacks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workers.contract import DEFAULT_MODEL_DIR  # noqa: E402
from workers.contract.channel import (  # noqa: E402
    Open,
    Opened,
    Step,
    Submit,
    channel_socket_path,
    frame,
    frame_length,
    to_router,
)
from workers.kv.batch import ForwardBatch, SeqChunk  # noqa: E402
from workers.kv.pool import KVPool  # noqa: E402
from workers.model.loader import load_model  # noqa: E402

PROMPT = "Hello, my name is"


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


class RawClient:
    """HTTP/1.1 over a Unix socket, one keep-alive connection, pre-encoded request."""

    def __init__(self, path: str, body: dict):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        payload = json.dumps(body).encode()
        self.request = (b"POST /generate HTTP/1.1\r\nhost: worker\r\ncontent-type: application/json\r\n"
                        b"content-length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)

    def generate(self) -> bytes:
        self.sock.sendall(self.request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += self.sock.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        while len(rest) < length:
            rest += self.sock.recv(65536)
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode() + rest.decode())
        return rest


class ChannelClient:
    """The engine channel over a blocking Unix socket: one `Submit`, then frames until its last record."""

    def __init__(self, path: str, request: dict):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(channel_socket_path(path))
        self.request, self.key = request, 0
        self.sock.sendall(frame(Open(ids=True)))
        opened = self._message()
        if not isinstance(opened, Opened):
            raise RuntimeError(f"the engine channel did not open: {opened}")

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise RuntimeError("the engine channel closed")
            data += chunk
        return data

    def _message(self):
        return to_router(self._exactly(frame_length(self._exactly(4))))

    def generate(self) -> bytes:
        self.key += 1
        self.sock.sendall(frame(Submit(self.key, self.request)))
        while True:
            message = self._message()
            if isinstance(message, Step):
                for key, data, end in message.records:
                    if key == self.key and end:
                        return data
            elif getattr(message, "status", 200) != 200:
                raise RuntimeError(str(message))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _compiled(sock: Path) -> bool:
    """Whether the worker's decode step is no longer compiling (a CPU worker compiles it behind
    its serving under `--compile auto`)."""
    import httpx

    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=5) as c:
            return (c.get("http://w/capability").json().get("compile") or {}).get("state") != "compiling"
    except (httpx.HTTPError, ValueError):
        return False


def start_worker(tmp: Path, args) -> tuple[subprocess.Popen, str]:
    sock, status = tmp / "w.sock", tmp / "status.json"
    cmd = [sys.executable, "-m", "workers", "--socket", str(sock), "--status-file", str(status),
           "--threads", str(args.threads), "--worker-id", "bench"]
    if args.simulate:
        cmd += ["--simulate", args.simulate]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSERVE_")}
    env.update(OMP_NUM_THREADS=str(args.threads), CUDA_VISIBLE_DEVICES="", HETSERVE_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if json.loads(status.read_text()).get("state") == "ready" and _compiled(sock):
                return proc, str(sock)  # measured as it serves from now on, not while it compiles behind
        except (OSError, ValueError):
            pass
        if proc.poll() is not None:
            raise RuntimeError("the worker exited before it was ready")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the worker was not ready (its decode step compiled) within 600 s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulate", default=None, help="simulated device of the worker (default: the CPU)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", metavar="FILE",
                   help="record the worker with py-spy into FILE (collapsed stacks, idle included)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(DEFAULT_MODEL_DIR, "auto")  # the worker's own choice on a CPU
    ids = lm.tokenizer.encode(PROMPT).ids
    pool = KVPool.for_config(lm.config, 1, 16, lm.dtype)
    table = [0]

    def bare() -> int:
        with torch.inference_mode():
            logits = lm.model.step(ForwardBatch.build([(SeqChunk(0, len(ids), table), ids)], 16), pool)
            return int(logits.argmax(-1)[0])

    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = start_worker(Path(tmp), args)
        spy = None
        if args.profile:  # attached once the worker is ready: only serving is recorded
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "-o", args.profile, "-f", "raw",
                                    "--threads", "--rate", "1000"], stdout=subprocess.DEVNULL)
            time.sleep(2)
        try:
            http = RawClient(sock, {"inputs": PROMPT, "parameters": {"max_new_tokens": 1}})
            channel = ChannelClient(sock, {"input_ids": ids, "parameters": {"max_new_tokens": 1}})
            sides = [("channel", channel.generate), ("http", http.generate), ("bare", bare)]
            times: dict[str, list[float]] = {name: [] for name, _ in sides}
            cpu = dict.fromkeys(times, 0.0)
            for i in range(args.requests + 30):
                for name, fn in sides[i % 3:] + sides[:i % 3]:  # each side first in turn
                    w0 = cpu_seconds(proc.pid)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    fn()
                    t1, c1 = time.perf_counter(), time.thread_time()
                    if i >= 30:  # after the warm-up
                        times[name].append((t1 - t0) * 1e3)
                        cpu[name] += (c1 - c0) if name == "bare" else cpu_seconds(proc.pid) - w0
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(timeout=60)
            proc.terminate()
            proc.wait(timeout=60)
    if args.profile:
        print(f"profile written to {args.profile}")
    where = args.simulate or "cpu"
    print(f"one-token generation on the worker (engine channel, HTTP /generate) vs bare prefill + argmax, "
          f"{len(ids)}-token prompt, {args.requests} each, alternated, {args.threads} thread(s), worker on {where}, "
          f"{lm.dtype}")
    per = {name: cpu[name] * 1e3 / args.requests for name in cpu}
    print(f"  {'':26}{'p50 ms':>8}{'p99 ms':>8}{'CPU ms':>8}")
    for name, label in (("channel", "worker, engine channel"), ("http", "worker, HTTP /generate"),
                        ("bare", "bare prefill + argmax")):
        print(f"  {label:26}{percentile(times[name], 50):8.2f}{percentile(times[name], 99):8.2f}{per[name]:8.2f}")
    for name, label in (("channel", "added, engine channel"), ("http", "added, HTTP /generate")):
        added50 = percentile(times[name], 50) - percentile(times["bare"], 50)
        added99 = percentile(times[name], 99) - percentile(times["bare"], 99)
        print(f"  {label:26}{added50:8.2f}{added99:8.2f}{per[name] - per['bare']:8.2f}"
              "   (target: p50 <= 1 ms on the channel)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
