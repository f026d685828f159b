"""The `hetserve` command line.

Each subcommand lives in its own module and is imported only when chosen, so `hetserve
devices` or `hetserve compose` never pay for (or initialize) what `serve` needs. Bad input
is a `UsageError`: one line naming the bad value and the accepted forms, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from server.config.budgets import add_budget_flags
from server.config.compile import add_compile_flags
from server.config.disaggregate import add_disaggregate_flags
from server.config.loras import add_lora_flags
from server.config.memory import add_memory_flags
from server.config.models import add_model_flags
from server.config.protocol import add_protocol_flags
from server.config.reasoning import add_reasoning_flags
from server.config.routing import add_routing_flags
from server.config.settings import CANARY_ACTIONS, RouterSettings
from server.config.speculative import add_speculative_flags
from server.errors import UsageError
from workers.contract import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_QUEUE,
    KV_BLOCK_SIZES,
    KV_HOST_SHARE,
    TopologySpecError,
)
from workers.contract.defaults import CPU_KV_MAX_DEFAULT_BYTES, GPU_FREE_FRACTION

# subcommand -> "module:function(args) -> int"
_COMMANDS = {
    "serve": "server.commands.serve:run",
    "plan": "server.commands.plan:run",
    "compose": "server.commands.compose:run",
    "devices": "server.commands.devices:run",
}


def _add_simulate(p) -> None:
    p.add_argument(
        "--simulate",
        metavar="SPEC",
        default=None,
        help="simulate a GPU topology on a CPU host, e.g. `sm_80,sm_89,sm_90` (tokens: sm_XY, gfxNNN, cpu)",
    )


def _add_network_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("network and auth", "where the router listens, who may call it, the edge's timeouts")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 picks a free one)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` (visible in `ps`: prefer --api-key-file or "
                        "$HETSERVE_API_KEY)")
    g.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file's first line")
    g.add_argument("--allow-unauthenticated-control", action="store_true",
                   help="without an API key, let anyone who reaches the server load and unload models (`POST "
                        "/models/NAME/load|unload`; default: refused with 403 unless --api-key is set)")
    g.add_argument("--header-timeout", type=float, default=None, metavar="S",
                   help="seconds a request's headers may take to arrive (default 10); then 408")
    g.add_argument("--body-timeout", type=float, default=None, metavar="S",
                   help="seconds a request body may pause (default 30); then 408")


def _add_device_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("devices", "which GPUs get a worker, or a simulated topology")
    g.add_argument("--devices", default="all", metavar="all|0,2|UUID,...",
                   help="GPUs to use: all, indices or UUIDs (default all)")
    _add_simulate(g)


def _add_engine_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("engine and memory", "each worker's batch, queue, KV cache and context")
    add_speculative_flags(g)
    g.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                   help=f"running sequences per worker (default {DEFAULT_MAX_BATCH})")
    g.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"waiting requests per worker before 429 (default {DEFAULT_MAX_QUEUE})")
    g.add_argument("--kv-block-size", type=int, default=DEFAULT_KV_BLOCK_SIZE, metavar="N",
                   help=f"tokens per KV cache block, one of {', '.join(map(str, KV_BLOCK_SIZES))} "
                        f"(default {DEFAULT_KV_BLOCK_SIZE})")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="workers do not reuse the KV blocks of shared prompt prefixes")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="tokens one engine step computes: running decodes first, then prompt chunks "
                        f"(default {DEFAULT_MAX_NUM_BATCHED_TOKENS} on a GPU, {CPU_MAX_NUM_BATCHED_TOKENS} where the "
                        "step computes on the CPU: a CPU or simulated device)")
    g.add_argument("--kv-cache-bytes", type=int, default=None, metavar="N",
                   help="KV cache budget of each worker in bytes "
                        f"(default: {round(GPU_FREE_FRACTION * 100)}%% of a GPU's free memory after loading; "
                        "on a CPU or simulated device what --max-batch sequences of "
                        f"the full context need, at most {CPU_KV_MAX_DEFAULT_BYTES >> 20} MiB; with "
                        "--gpu-memory-utilization, a cap on its budget)")
    g.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads of all workers together, shared evenly (default: this process's CPUs, less "
                        "one for the router and the HTTP side where the workers compute on the CPU: a CPU or "
                        "simulated device)")
    g.add_argument("--kv-host-bytes", type=int, default=None, metavar="N",
                   help="host-memory KV tier shared by the workers of the same model and KV format, in bytes: "
                        "prefixes evicted from a device are copied back instead of recomputed "
                        f"(default: {round(KV_HOST_SHARE * 100)}%% of MemAvailable at a worker's start; 0: off)")
    add_memory_flags(g)
    add_lora_flags(serve)


def _add_failure_flags(serve: argparse.ArgumentParser) -> None:
    d = RouterSettings()
    g = serve.add_argument_group("failures", "stream migration, circuit breakers, hang detection")
    g.add_argument("--migration-limit", type=int, default=None, metavar="N",
                   help=f"times a stream may move to another worker when its own is lost (default {d.migration_limit}; "
                        "0: end it with an error event instead)")
    g.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                   help="seconds a worker may hold pending work without completing an engine step before it is "
                        f"taken for hung and restarted (default {d.stall_timeout_s:g})")
    g.add_argument("--health-timeout", type=float, default=None, metavar="S",
                   help=f"seconds a worker's health probe may go unanswered before it is taken for hung "
                        f"(default {d.health_timeout_s:g}; probes run every {d.health_interval_s:g} s)")
    g.add_argument("--breaker-failures", type=int, default=None, metavar="N",
                   help=f"consecutive failed requests (connection errors, 5xx, lost streams) that open a worker's "
                        f"circuit breaker (default {d.breaker_failures})")
    g.add_argument("--breaker-cooldown", type=float, default=None, metavar="S",
                   help=f"seconds an open breaker keeps requests away before one probe request "
                        f"(default {d.breaker_cooldown_s:g})")


def _add_numerics_flags(serve: argparse.ArgumentParser) -> None:
    d = RouterSettings()
    g = serve.add_argument_group("numerics", "deterministic mode and the cross-worker canary")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics on every worker: a request's output does not depend on what "
                        "else the worker runs (fixed GEMM row tiles and attention splits; some throughput)")
    g.add_argument("--canary-interval", type=float, default=None, metavar="S",
                   help="seconds between canary rounds, which score a fixed set of short prompts on every ready "
                        f"worker and compare them (default {d.canary_interval_s:g}; 0: off)")
    g.add_argument("--canary-min-agreement", type=float, default=None, metavar="F",
                   help="fraction of canary tokens that must equal the reference's where the numerics may "
                        f"differ; below it a worker is suspect (default {d.canary_min_agreement:g}; exact where "
                        "both run --deterministic with the same kernels)")
    g.add_argument("--canary-action", default=None, choices=CANARY_ACTIONS,
                   help="what a suspect worker gets: mark (shown in /workers, /metrics, /health) or drain (also "
                        f"out of rotation, restarted, checked again before it serves; default {d.canary_action})")


def _version() -> str:
    """The installed distribution's version (the checkout's pyproject when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hetserve")
    except PackageNotFoundError:
        return "unknown (not installed: `pip install -e .`)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetserve",
        description="Inference server for hosts whose GPUs are of different architectures.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                        help="print hetserve's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser("serve", help="start the router and one worker per GPU")
    add_model_flags(serve)
    _add_network_flags(serve)
    _add_device_flags(serve)
    _add_engine_flags(serve)
    add_routing_flags(serve)
    add_disaggregate_flags(serve.add_argument_group(
        "disaggregation", "prefill long prompts on one worker, decode them on another"))
    _add_failure_flags(serve)
    add_budget_flags(serve)
    add_reasoning_flags(serve)
    add_protocol_flags(serve)
    _add_numerics_flags(serve)
    add_compile_flags(serve)
    obs = serve.add_argument_group("observability", "logs and traces")
    obs.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                     help="the router's and workers' log level (default info)")
    obs.add_argument("--otlp-endpoint", default=None, metavar="URL",
                     help="export OpenTelemetry spans of the router and every worker to this OTLP collector "
                          "(e.g. http://collector:4318; off by default)")

    plan = sub.add_parser("plan", help="show which model each device serves, then per device the fp8 convention and "
                                       "the kernels its model runs, with reasons, without loading weights")
    _add_simulate(plan)
    plan.add_argument("--devices", default="all", metavar="all|0,2|UUID,...")
    plan.add_argument("--json", action="store_true", help="print JSON (every kernel of every device, always)")
    plan.add_argument("--all-kernels", action="store_true",
                      help="list every kernel each device selects, the ones its model does not run too (each with "
                           "why), and those of devices that serve no model; by default a device lists only the "
                           "kernels its model runs (every one without --model)")  # fmt: skip
    plan.add_argument("--compile", action="store_true",
                      help="also compile every selected Triton kernel for each device's target (no GPU needed) and "
                           "check it against the device's limits; exits 1 if any is refused")  # fmt: skip
    plan.add_argument("--model", metavar="[NAME=]DIR", action="append", default=None,
                      help="a model directory: where it is placed (per device, with the bytes and the reason), its "
                           "architecture and, per device, the kernels it runs and the attention each layer type "
                           "gets (full, sliding) and why; repeatable: which device serves which model")  # fmt: skip
    plan.add_argument("--place", metavar="NAME=DEV[,DEV...]", action="append", default=None,
                      help="pin a model's replicas to these devices, as `serve --place` does (`gpu0+gpu2`: one "
                           "pipeline replica)")
    plan.add_argument("--pipeline", metavar="auto|N", default="auto", help="as `serve --pipeline`")
    plan.add_argument("--pipeline-partition", metavar="N,N[,N...]", default=None,
                      help="as `serve --pipeline-partition`")
    plan.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                      help="the dtype the placement sizes weights in, as `serve --dtype`")
    plan.add_argument("--quantize", default="none", choices=["none", "fp8"],
                      help="as `serve --quantize`: fp8 projections take one byte per weight and run Fp8Linear")

    compose = sub.add_parser("compose", help="write a docker compose file for this host's GPUs")
    _add_simulate(compose)
    compose.add_argument("--model", metavar="DIR", default=None, help="host model directory to mount")
    compose.add_argument("--output", "-o", metavar="FILE", default=None, help="write here instead of stdout")
    compose.add_argument("--port", type=int, default=8000)
    compose.add_argument("--image", default="hetserve:latest")
    compose.add_argument("--devices", default="all", metavar="all|0,2|UUID,...", help="GPUs to pin (default all)")

    devices = sub.add_parser("devices", help="list this host's GPUs (NVML) or the simulated ones")
    _add_simulate(devices)
    devices.add_argument("--devices", default="all", metavar="all|0,2|UUID,...")
    devices.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, func_name = _COMMANDS[args.command].split(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        return int(func(args) or 0)
    except (UsageError, TopologySpecError) as e:
        print(f"hetserve {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
