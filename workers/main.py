"""The worker process: one device, one model, one engine, one Unix socket.

`run_worker(args)` reads top-down as the mission: bind -> capability -> load -> kernelize ->
fp8 -> serve. Everything is built inside this process (vLLM `run_engine_core` style): the
router passes only arguments and environment. Each startup step is logged once with its
duration and written to the status file, so a worker that cannot start says which step
failed and why (exit 3), distinct from a fatal error while serving (exit 4). A clean
shutdown (SIGTERM, or the parent dying) drains in-flight requests within a bound and
exits 0. Cleanup happens in `finally`, whatever the path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED_TO_START, EXIT_FATAL = 0, 3, 4
STEPS = ("bind", "capability", "load", "kernelize", "fp8", "serve")
DRAIN_TIMEOUT_S = 30.0
PARENT_POLL_S = 0.5
GPU_FREE_FRACTION = 0.85  # of the bound device's free memory after loading; the rest for activations
CPU_KV_DEFAULT_BYTES = 512 << 20
MIN_SEQ_LEN = 512


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers", description="hetserve worker: serve one device.")
    p.add_argument("--socket", required=True, help="Unix socket path to listen on (created with mode 0600)")
    p.add_argument("--worker-id", help="name in logs, headers and /capability (default: worker-<device index>)")
    p.add_argument("--model", help="HF-layout model directory (default: the embedded model)")
    p.add_argument("--simulate", help="simulated device token, e.g. sm_89, gfx942, cpu")
    p.add_argument("--device-index", type=int, help="physical device index (default: $HETSERVE_DEVICE_INDEX or 0)")
    p.add_argument("--device-uuid", help="device UUID to check after binding")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--quantize", default="none", choices=("none", "fp8"))
    p.add_argument("--max-batch", type=int, default=32, help="most sequences running at once (KV slots)")
    p.add_argument("--max-queue", type=int, default=128, help="requests waiting beyond the batch before 429")
    p.add_argument("--kv-cache-bytes", type=int, help="KV cache budget (default: free GPU memory, or 512 MiB on CPU)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--status-file", help="JSON status file, rewritten atomically at each step")
    p.add_argument("--parent-pid", type=int, help="exit when this process dies")
    args = p.parse_args(argv)
    for name in ("max_batch", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"`--{name.replace('_', '-')}` must be >= 1, got `{value}`")
    if args.max_queue < 0:
        p.error(f"`--max-queue` must be >= 0, got `{args.max_queue}`")
    return args


class StartupError(RuntimeError):
    """A startup step that cannot complete; `step` names it."""

    def __init__(self, step: str, reason: str):
        super().__init__(f"{step}: {reason}")
        self.step, self.reason = step, reason


class _ShutdownRequested(BaseException):
    """SIGTERM (or the parent's death) before serving started."""


class StatusFile:
    """The JSON status the router reads; rewritten atomically (write + rename)."""

    def __init__(self, path: str | None, worker_id: str):
        self.path, self.worker_id = path, worker_id

    def write(self, state: str, **fields) -> None:
        if not self.path:
            return
        body = {"state": state, **fields, "worker_id": self.worker_id, "pid": os.getpid(), "time": time.time()}
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.path)


@contextlib.contextmanager
def startup_step(name: str, status: StatusFile) -> Iterator[None]:
    """Run one mission step: status `starting`, one log line with its duration, and any
    exception turned into `StartupError(name, reason)`."""
    status.write("starting", step=name)
    t0 = time.perf_counter()
    try:
        yield
    except (StartupError, _ShutdownRequested):
        raise
    except Exception as e:
        raise StartupError(name, f"{type(e).__name__}: {e}") from e
    logger.info("step %s done in %.3fs", name, time.perf_counter() - t0)


def _default_worker_id(args: argparse.Namespace) -> str:
    index = args.device_index if args.device_index is not None else os.environ.get("HETSERVE_DEVICE_INDEX", "0")
    return f"worker-{index}"


def configure_logging(worker_id: str) -> None:
    logging.basicConfig(
        level=os.environ.get("HETSERVE_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s [{worker_id}] %(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.worker_id = args.worker_id or _default_worker_id(args)
    configure_logging(args.worker_id)
    return run_worker(args)


def run_worker(args: argparse.Namespace) -> int:
    """bind -> capability -> load -> kernelize -> fp8 -> serve."""
    status = StatusFile(args.status_file, args.worker_id)
    phase: dict = {"server": None}  # the uvicorn server once serving
    _install_sigterm(phase)
    _watch_parent(args.parent_pid)
    server = None
    try:
        with startup_step("bind", status):
            from workers.device import bind_device

            bound = bind_device(args.simulate, args.device_index, args.device_uuid)
        if args.threads:  # the CPU threads the router gave this worker, before any compute
            import torch

            torch.set_num_threads(args.threads)
        with startup_step("capability", status):
            from workers.device import capability, check_kernels_capability

            cap = capability()
            ok, why = check_kernels_capability(bound)
            if not ok:
                raise StartupError("capability", why)
            logger.info("capability %s (%s): %s", bound.capability_str or "none", bound.type, why)
        with startup_step("load", status):
            from workers.loader import default_model_dir, load_model

            loaded = load_model(args.model or default_model_dir(), args.dtype, bound.torch_device, cap)
        with startup_step("kernelize", status):
            from workers.kernelize import kernelize_for_device

            kernels = kernelize_for_device(loaded.model, bound)
        with startup_step("fp8", status):
            from workers.fp8 import choose_fp8, lock_convention

            conv, fp8_reason = choose_fp8(bound.type, cap)
            lock_convention(conv)
            if args.quantize == "fp8":
                from workers.quantize import quantize_model

                logger.info("fp8 weights: %s", quantize_model(loaded.model, conv))
            logger.info("fp8 convention %s: %s", conv.name, fp8_reason)
        with startup_step("serve", status):
            server = WorkerServer(args, bound, loaded, kernels, conv, fp8_reason)
        phase["server"] = server.server
        server.run(on_ready=lambda: status.write("ready", socket=args.socket))
        if server.fatal_error is not None:
            status.write("fatal", reason=f"{type(server.fatal_error).__name__}: {server.fatal_error}")
            return EXIT_FATAL
        status.write("stopped")
        return EXIT_OK
    except StartupError as e:
        logger.exception("failed to start at step %s: %s", e.step, e.reason)
        status.write("failed", step=e.step, reason=e.reason)
        return EXIT_FAILED_TO_START
    except _ShutdownRequested:
        logger.info("shutdown requested before serving; exiting")
        status.write("stopped")
        return EXIT_OK
    except Exception as e:
        logger.exception("fatal error while serving")
        status.write("fatal", reason=f"{type(e).__name__}: {e}")
        return EXIT_FATAL
    finally:
        if server is not None:
            server.close()


def _install_sigterm(phase: dict) -> None:
    """Before serving, SIGTERM ends startup at once; while serving, uvicorn owns SIGTERM (graceful
    drain) and afterwards re-raises it into this handler, which then has nothing left to do."""

    def on_sigterm(signum, frame):
        server = phase.get("server")
        if server is None:
            raise _ShutdownRequested()
        server.should_exit = True  # between the serve step and uvicorn taking over SIGTERM

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def _watch_parent(parent_pid: int | None) -> None:
    """A daemon thread that sends this process SIGTERM once `parent_pid` is gone."""
    if not parent_pid:
        return
    was_parent = os.getppid() == parent_pid

    def alive() -> bool:
        if was_parent and os.getppid() != parent_pid:  # re-parented: our parent exited
            return False
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def watch():
        while alive():
            time.sleep(PARENT_POLL_S)
        logger.warning("parent process %s is gone; shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def bind_unix_socket(path: str) -> socket.socket:
    """A listening Unix socket that is 0600 from its creation (umask), never world-reachable."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if p.is_socket():
            p.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(p))
    finally:
        os.umask(old)
    os.chmod(p, 0o600)
    sock.listen(2048)
    return sock


# -- the serve step ----------------------------------------------------------------------------


def kv_budget(args: argparse.Namespace, bound) -> tuple[int, str]:
    """This worker's KV cache budget in bytes, from its own device only, with the reason."""
    if bound.is_real_gpu:
        import torch

        free, _total = torch.cuda.mem_get_info(bound.torch_device)
        usable = int(free * GPU_FREE_FRACTION)
        if args.kv_cache_bytes:
            return min(args.kv_cache_bytes, usable), f"--kv-cache-bytes {args.kv_cache_bytes}, capped at {usable} usable"
        return usable, f"{GPU_FREE_FRACTION:.0%} of the bound device's {free} free bytes after loading"
    if args.kv_cache_bytes:
        return args.kv_cache_bytes, f"--kv-cache-bytes {args.kv_cache_bytes}"
    return CPU_KV_DEFAULT_BYTES, f"default CPU budget {CPU_KV_DEFAULT_BYTES} bytes"


def plan_kv_shape(bytes_per_token: int, context: int, budget: int, max_batch: int) -> tuple[int, int, str]:
    """(slots, max_seq_len, reason): `max_batch` slots as long as the budget allows, down to
    `MIN_SEQ_LEN` tokens (or the context); below that, fewer slots of that length."""
    seq_len = min(context, budget // (max_batch * bytes_per_token))
    floor = min(context, MIN_SEQ_LEN)
    if seq_len >= floor:
        return max_batch, seq_len, f"{max_batch} slots x {seq_len} tokens (context {context})"
    slots = budget // (floor * bytes_per_token)
    return slots, floor, f"budget fits {slots} of {max_batch} slots at {floor} tokens"


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("hetserve", "torch", "triton", "kernels"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


class WorkerServer:
    """KV cache + engine + HTTP app + uvicorn on the Unix socket: built by the serve step."""

    def __init__(self, args, bound, loaded, kernels: dict, conv, fp8_reason: str):
        self.args, self.bound, self.loaded = args, bound, loaded
        self._init_kv_cache()
        self._init_engine()
        self._init_app(kernels, conv, fp8_reason)
        self._init_server()

    def _init_kv_cache(self) -> None:
        from workers.kv_cache import KVCache

        cfg, dtype = self.loaded.config, self.loaded.dtype
        budget, why = kv_budget(self.args, self.bound)
        slots, seq_len, shape = plan_kv_shape(KVCache.bytes_per_token(cfg, dtype), cfg.max_position_embeddings, budget, self.args.max_batch)
        self.kv = KVCache.for_budget(cfg, dtype, self.bound.torch_device, budget, slots, seq_len)
        logger.info("KV cache %s bytes: %s; budget %s (%s)", self.kv.nbytes, shape, budget, why)

    def _init_engine(self) -> None:
        from workers.engine import Engine, ModelRunner
        from workers.scheduler import Scheduler, SchedulerConfig

        config = SchedulerConfig(self.kv.num_slots, self.kv.max_seq_len, eos_token_ids=self.loaded.eos_token_ids)
        runner = ModelRunner(self.loaded.model, self.kv, self.bound.torch_device)
        self.engine = Engine(runner, Scheduler(config), self.loaded.tokenizer, max_queue=self.args.max_queue,
                             on_fatal=self._on_fatal)

    def _init_app(self, kernels: dict, conv, fp8_reason: str) -> None:
        from workers.api import WorkerInfo, create_app

        loaded, kv = self.loaded, self.kv
        model = {"id": loaded.model_id, "dtype": str(loaded.dtype).removeprefix("torch."),
                 "context_length": loaded.config.max_position_embeddings}
        for key in ("chat_template", "eos_token", "bos_token"):
            if getattr(loaded, key) is not None:
                model[key] = getattr(loaded, key)
        # The model's recommended sampling (generation_config.json), which the OpenAI routes
        # apply to fields a request leaves out, as vLLM does.
        model["sampling_defaults"] = {
            k: loaded.generation_config[k]
            for k in ("temperature", "top_p", "top_k", "repetition_penalty")
            if isinstance(loaded.generation_config.get(k), (int, float))
        }
        info = WorkerInfo(
            worker_id=self.args.worker_id,
            device=self.bound.to_dict(),
            capability_label=self.bound.capability_str or "cpu",
            fp8={"convention": conv.name, "reason": fp8_reason},
            kernels={k: (v.to_dict() if hasattr(v, "to_dict") else dict(v)) for k, v in kernels.items()},
            capacity={**self.engine.scheduler.capacity(), "kv_cache_bytes": kv.nbytes},
            model=model,
            versions=_versions(),
        )
        self.app = create_app(info, self.engine, loaded.tokenizer, drain_timeout=DRAIN_TIMEOUT_S)

    def _init_server(self) -> None:
        import uvicorn

        self.sock = bind_unix_socket(self.args.socket)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="on",
                                timeout_graceful_shutdown=DRAIN_TIMEOUT_S)
        self.server = uvicorn.Server(config)

    def _on_fatal(self, exc: BaseException) -> None:
        """Engine thread: the model failed; stop serving so the router restarts this worker."""
        self.server.should_exit = True

    @property
    def fatal_error(self) -> BaseException | None:
        return self.engine.fatal_error

    def run(self, on_ready) -> None:
        async def serve():
            task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
            while not self.server.started and not task.done():
                await asyncio.sleep(0.01)
            if self.server.started:
                on_ready()
                logger.info("ready on %s", self.args.socket)
            await task

        asyncio.run(serve())

    def close(self) -> None:
        self.engine.shutdown(0.0)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.args.socket)
