"""A stand-in worker for router tests: the worker's socket API without a model or torch.

Speaks the worker contract (`python -m workers --config FILE`, status file, exit codes, Unix
socket with /health, /capability, /generate, /generate_stream, /metrics, the X-Worker-*
headers, 422/429/503 JSON errors) and produces deterministic text: token i is ` t{i}` (id
100 + i); a request with `resume_ids` goes on from token len(resume_ids), as a real worker
continues a migrated stream; `/tokenize` gives a token per word, `/detokenize` ` t{id - 100}`
per id, `/embed` `[length, 1]` per input. `/health` reports engine liveness (`engine.pending`,
`engine.last_step_age_s`). Behaviour for tests comes from the environment:

  FAKE_FAIL_STEP=kernelize     write a `failed` status at that step and exit 3
  FAKE_FAIL_IDS=gpu0           only these workers fail (default: all, when FAKE_FAIL_STEP is set)
  FAKE_EXIT_AT_START=1         exit 1 before writing anything (a crash loop)
  FAKE_STARTUP_S=0.5           seconds before becoming ready
  FAKE_TOKEN_S=0.002           seconds per generated token
  FAKE_CRASH_IDS=gpu0          workers that die on the prompts `__crash_before_first__`
                               (before any token) and `__crash_mid_stream__` (after 2 tokens),
                               answer 500 to `__error_500__`, and on `__stall_mid_stream__`
                               stop producing tokens after 2 while /health reports the engine
                               stalled (work pending, the last step ever older)
  FAKE_ERROR_IDS=gpu2          workers that answer 500 to every generation request
  FAKE_PAD_BYTES=4096          characters added to every token's text (streams of many bytes)
  (any worker)                 the prompt `__request_failed__` is answered 500 `request_failed`
                               (a stream: an error event of that type after 2 tokens), as a
                               real worker answers a request that raised while it serves on
  FAKE_TRACE_LOG=/path         append `<worker id> <traceparent header or ->` per generation
                               request (what the router propagated)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from workers.contract import WorkerConfig


def parse_args(argv=None) -> WorkerConfig:
    """The worker's own configuration (`--config FILE`, as the router starts it, or flags), with the
    stand-in's defaults for what a hand-started one leaves out."""
    config = WorkerConfig.from_argv(argv, environ={})
    return replace(config, worker_id=config.worker_id or "w0",
                   device_index=0 if config.device_index is None else config.device_index,
                   device_uuid=config.device_uuid or "GPU-fake")


def write_status(path, **status):
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)


def capability_of(token):
    arch = (token or "").split(":")[0]  # `sm_86:24GiB`: the device's memory follows its arch
    if not arch or arch == "cpu":
        return None
    digits = arch.removeprefix("sm_")
    return (int(digits[:-1]), int(digits[-1]))


def memory_of(token):
    from workers.contract import simulated_device

    return simulated_device(token, 0).memory_total_bytes if token else 1 << 30


def build_app(args) -> FastAPI:
    cap = capability_of(args.simulate)
    cap_str = "cpu" if cap is None else f"{cap[0]}.{cap[1]}"
    native = cap is not None and cap >= (8, 9)
    fp8 = {"convention": "native_e4m3" if native else "emulated",
           "reason": f"capability {cap_str} {'>=' if native else '<'} 8.9"}
    token_s = float(os.environ.get("FAKE_TOKEN_S", "0.002"))
    crashes = args.worker_id in os.environ.get("FAKE_CRASH_IDS", "").split(",")
    broken = args.worker_id in os.environ.get("FAKE_ERROR_IDS", "").split(",")
    capacity = args.max_batch + args.max_queue
    state = {"inflight": 0, "served": 0, "tokens": 0, "stalled_since": None, "request_failed": 0}
    trace_log = os.environ.get("FAKE_TRACE_LOG")

    def log_trace(request):
        if trace_log:
            with open(trace_log, "a") as f:
                f.write(f"{args.worker_id} {request.headers.get('traceparent', '-')}\n")
    headers = {"X-Worker-Id": args.worker_id, "X-Worker-Capability": cap_str, "X-Fp8-Convention": fp8["convention"]}
    app = FastAPI()

    def error(status, msg, kind):
        extra = {"Retry-After": "1"} if status == 429 else {}
        return JSONResponse({"error": msg, "error_type": kind}, status_code=status, headers={**headers, **extra})

    def validate(body):
        params = body.get("parameters") or {}
        if broken:
            return None, error(500, "fake broken worker", "internal")
        if not isinstance(body.get("inputs"), str) or not body["inputs"]:
            return None, error(422, "`inputs` must be a non-empty string", "validation")
        n = params.get("max_new_tokens") or 20
        if n > 512:
            return None, error(422, f"`max_new_tokens` {n} exceeds 512", "validation")
        resumed = body.get("resume_ids") or []
        if len(resumed) >= n:
            return None, error(422, f"`resume_ids` holds {len(resumed)} tokens, `max_new_tokens` is {n}", "validation")
        if state["inflight"] >= capacity:
            return None, error(429, "queue full", "overloaded")
        return (body["inputs"], n, params, len(resumed)), None

    pad = "x" * int(os.environ.get("FAKE_PAD_BYTES", "0"))

    def token(i):
        return {"id": 100 + i, "text": f" t{i}{pad}", "logprob": -0.5, "special": False}

    def details(prompt, n, params):
        return {"finish_reason": "length", "generated_tokens": n, "input_length": len(prompt.split()),
                "seed": params.get("seed")}

    @app.get("/health")
    async def health():
        stalled = state["stalled_since"]
        engine = {"pending": state["inflight"] > 0, "steps": state["tokens"],
                  "last_step_age_s": 0.0 if stalled is None else time.monotonic() - stalled}
        return {"status": "ready", "worker_id": args.worker_id, "engine": engine}

    @app.get("/capability")
    async def capability():
        return {
            "worker_id": args.worker_id, "pid": os.getpid(),
            "device": {"type": "cpu" if cap is None else "cuda", "index": args.device_index, "uuid": args.device_uuid,
                       "name": f"fake {args.simulate}", "capability": None if cap is None else cap_str,
                       "simulated": True, "memory_total_bytes": memory_of(args.simulate)},
            "fp8": fp8,
            "kernels": {"RMSNorm": {"repo": "fake", "layer": "RMSNorm", "variant": "torch", "reason": "fake"}},
            "capacity": {"max_sequences": args.max_batch, "max_tokens": 4096, "max_seq_len": 512, "kv_cache_bytes": 0},
            "model": {"id": "fake-model", "dtype": "float32", "context_length": 512,
                      "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                                       "{% if add_generation_prompt %}<assistant>{% endif %}",
                      "eos_token": "</s>", "bos_token": "<s>"},
            "versions": {"hetserve": "0.1.0"},
            "load": {"running": state["inflight"], "queued": 0},
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# HELP hetserve_worker_requests_total Requests served.\n# TYPE hetserve_worker_requests_total counter\n"
            f"hetserve_worker_requests_total {state['served']}\n"
            "# HELP hetserve_worker_queue_depth Waiting requests.\n# TYPE hetserve_worker_queue_depth gauge\n"
            'hetserve_worker_queue_depth{kind="waiting"} 0\n'
            "# HELP hetserve_worker_generated_tokens_total Tokens generated.\n"
            "# TYPE hetserve_worker_generated_tokens_total counter\n"
            f"hetserve_worker_generated_tokens_total {state['tokens']}\n"
            f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
            f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {state['inflight']}\n"
            f"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc {state['inflight'] / args.max_batch}\n"
        )

    @app.post("/generate")
    async def generate(request: Request):
        log_trace(request)
        parsed, err = validate(await request.json())
        if err:
            return err
        prompt, n, params, _ = parsed
        if crashes and prompt.startswith("__crash"):
            os._exit(1)
        if crashes and prompt == "__error_500__":
            return error(500, "fake internal error", "internal")
        if prompt == "__request_failed__":
            state["request_failed"] += 1
            return error(500, "Processing the request failed on the worker (ValueError); see its log", "request_failed")
        state["inflight"] += 1
        try:
            await asyncio.sleep(token_s * n)
        finally:
            state["inflight"] -= 1
        state["served"] += 1
        state["tokens"] += n
        text = "".join(f" t{i}" for i in range(n))
        body = {"generated_text": (prompt + text) if params.get("return_full_text") else text}
        if params.get("details"):
            body["details"] = {**details(prompt, n, params), "prefill": [], "tokens": [token(i) for i in range(n)]}
        return JSONResponse(body, headers=headers)

    @app.post("/generate_stream")
    async def generate_stream(request: Request):
        log_trace(request)
        parsed, err = validate(await request.json())
        if err:
            return err
        prompt, n, params, start = parsed
        if crashes and prompt == "__crash_before_first__":
            os._exit(1)

        async def events():
            state["inflight"] += 1
            try:
                for i in range(start, n):
                    await asyncio.sleep(token_s)
                    state["tokens"] += 1
                    if crashes and prompt == "__crash_mid_stream__" and i == 2:
                        os._exit(1)
                    if prompt == "__request_failed__" and i == 2:
                        state["request_failed"] += 1
                        error = {"error": "Processing failed (ValueError)", "error_type": "request_failed"}
                        yield f"data: {json.dumps(error)}\n\n"
                        return
                    if crashes and prompt == "__stall_mid_stream__" and i == 2:
                        state["stalled_since"] = state["stalled_since"] or time.monotonic()
                        await asyncio.Event().wait()  # hangs until the router gives up on it
                    last = i == n - 1
                    event = {"index": i, "token": token(i),
                             "generated_text": "".join(f" t{j}" for j in range(n)) if last else None,
                             "details": details(prompt, n, params) if last else None}
                    yield f"data: {json.dumps(event)}\n\n"
            finally:
                state["inflight"] -= 1
                state["served"] += 1

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await request.json()
        words = body["prompt"].split()  # a token per word, id 100 + its length
        return JSONResponse({"count": len(words), "tokens": [100 + len(w) for w in words],
                             "token_strs": words if body.get("return_token_strs") else None,
                             "max_model_len": 512}, headers=headers)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tokens = (await request.json())["tokens"]
        return JSONResponse({"prompt": "".join(f" t{t - 100}" for t in tokens)}, headers=headers)

    @app.post("/embed")
    async def embed(request: Request):
        inputs = (await request.json())["inputs"]  # a vector per input: [its length, 1]
        return JSONResponse({"embeddings": [[float(len(item)), 1.0] for item in inputs],
                             "tokens": [len(item) if isinstance(item, list) else len(item.split()) for item in inputs]},
                            headers=headers)

    return app


async def watch_parent(pid):
    while True:
        await asyncio.sleep(0.5)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("FAKE_EXIT_AT_START"):
        return 1
    write_status(args.status_file, state="starting", step="bind")
    fail_step = os.environ.get("FAKE_FAIL_STEP")
    fail_ids = os.environ.get("FAKE_FAIL_IDS")
    if fail_step and (not fail_ids or args.worker_id in fail_ids.split(",")):
        write_status(args.status_file, state="failed", step=fail_step, reason=f"fake failure at {fail_step}")
        return 3
    time.sleep(float(os.environ.get("FAKE_STARTUP_S", "0")))
    app = build_app(args)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(args.socket)
    os.chmod(args.socket, 0o600)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    async def serve():
        if args.parent_pid:
            asyncio.get_running_loop().create_task(watch_parent(args.parent_pid))
        write_status(args.status_file, state="ready")
        await server.serve(sockets=[sock])

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
