"""Values the router and the worker must agree on: defaults, timeouts and header names.

The router passes most of these to each worker on its command line, but a worker started by
hand (`python -m workers`) must behave the same, so both read the defaults from here.
"""

from __future__ import annotations

from pathlib import Path

# The embedded checkpoint served without `--model`. Found by path: nothing is imported.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"

DEFAULT_MAX_BATCH = 32  # sequences running at once per worker
DEFAULT_MAX_QUEUE = 256  # requests waiting per worker beyond the batch before it answers 429
DRAIN_TIMEOUT_S = 30.0  # in-flight requests get this long after SIGTERM (router and worker)

# The paged KV cache and the engine's step budget (`--kv-block-size`, `--max-num-batched-tokens`).
DEFAULT_KV_BLOCK_SIZE = 16  # tokens per KV cache block
KV_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # powers of two: the GPU kernel's tiles stay aligned
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # tokens one engine step computes (decodes first, then prompt chunks)
CPU_MAX_NUM_BATCHED_TOKENS = 1024  # the same where the step computes on the CPU (`step_token_budget`)


def step_token_budget(computes_on_cpu: bool, max_batch: int = DEFAULT_MAX_BATCH) -> int:
    """The default `--max-num-batched-tokens` of a worker (at least `max_batch`): 2048 on a GPU;
    1024 where the step computes on the CPU (a CPU or a simulated device), whose step of 2048
    prompt tokens is long even for a small model, every running stream waiting for it. The
    smaller budget cut the time to first token under bursts at a small cost per output token
    (docs/benchmarks.md, "Against vLLM")."""
    return max(max_batch, CPU_MAX_NUM_BATCHED_TOKENS if computes_on_cpu else DEFAULT_MAX_NUM_BATCHED_TOKENS)


def engine_limits_error(kv_block_size: int, max_num_batched_tokens: int | None, max_batch: int) -> str | None:
    """Why these engine flags cannot work together (one message naming the value and what is
    allowed), or None. The router checks them before it spawns anything; a worker started by
    hand checks the same. `max_num_batched_tokens` None: the device's default, at least `max_batch`."""
    if kv_block_size not in KV_BLOCK_SIZES:
        return f"`--kv-block-size {kv_block_size}` is not supported. Supported: {', '.join(map(str, KV_BLOCK_SIZES))}"
    if max_num_batched_tokens is not None and max_num_batched_tokens < max_batch:
        return (
            f"`--max-num-batched-tokens {max_num_batched_tokens}` must be >= `--max-batch {max_batch}`: every "
            f"running sequence decodes one token per step within that budget"
        )
    return None

# The environment the router gives each worker before its Python starts (with
# CUDA_DEVICE_ORDER / CUDA_VISIBLE_DEVICES): which device it binds, and whether it is simulated.
ENV_SIMULATE = "HETSERVE_SIMULATE"
ENV_DEVICE_INDEX = "HETSERVE_DEVICE_INDEX"
ENV_DEVICE_UUID = "HETSERVE_DEVICE_UUID"

# Whether a worker compiles and checks its selected kernels before ready (`--preflight`):
# auto = on real GPUs only, on = simulated GPUs too (compiled for their target), off = never.
ENV_PREFLIGHT = "HETSERVE_PREFLIGHT"
PREFLIGHT_MODES = ("auto", "on", "off")

# Whether a worker compiles its decode step per batch bucket (`--compile`), when the flag is
# not given: auto (workers/engine/compiled.py `decide`), on, off. The test suite sets it to off
# (tests/conftest.py): dozens of CPU workers each compiling at start would cost minutes.
ENV_COMPILE = "HETSERVE_COMPILE"
COMPILE_MODES = ("auto", "on", "off")

# Response headers: which worker answered, its capability and its fp8 convention.
HEADER_WORKER_ID = "X-Worker-Id"
HEADER_WORKER_CAPABILITY = "X-Worker-Capability"
HEADER_FP8_CONVENTION = "X-Fp8-Convention"
WORKER_HEADERS = (HEADER_WORKER_ID, HEADER_WORKER_CAPABILITY, HEADER_FP8_CONVENTION)
# The generate request field that carries the token ids a migrated stream already delivered:
# the worker that takes the stream over goes on after them (workers/engine/resume.py).
RESUME_IDS = "resume_ids"
# The router's stream channel to a worker (workers/serving/channel.py): `GET /streams` opens one
# (the worker names it in `X-Hetserve-Channel`); a `POST /generate_stream` carrying both headers
# is answered at once and its events travel on that channel under the router's stream key;
# `POST /streams/abort` ends streams whose client left.
HEADER_CHANNEL = "X-Hetserve-Channel"
HEADER_STREAM_KEY = "X-Hetserve-Stream"
# `GET /streams` with `X-Hetserve-Text: ids` opens a channel whose records are token ids
# (workers/contract/events.py): the router detokenizes, finds stop strings and renders, with the
# tokenizer `GET /tokenizer` gives (its JSON; the model's vocabulary size in `X-Hetserve-Vocab`).
HEADER_TEXT = "X-Hetserve-Text"
TEXT_IDS = "ids"
HEADER_VOCAB = "X-Hetserve-Vocab"
# Request headers that constrain routing (matched case-insensitively).
HEADER_PIN_WORKER = "X-Hetserve-Worker"
HEADER_MIN_CAPABILITY = "X-Hetserve-Min-Capability"
HEADER_FP8 = "X-Hetserve-Fp8"
# The model a TGI-shaped request is for (OpenAI requests name it in `model`); every answer of a
# model's route carries the model that served it under the same name.
HEADER_MODEL = "X-Hetserve-Model"

# The gauges Kubernetes inference gateways scrape (Gateway API Inference Extension, model server
# protocol: TotalQueuedRequests, TotalRunningRequests, KVCacheUtilization as a 0..1 fraction),
# under the vLLM names its endpoint picker reads by default. `vllm:gpu_cache_usage_perc` is the
# KV name of older endpoint pickers. Each worker serves them; the router adds the pod's totals.
GATEWAY_WAITING = "vllm:num_requests_waiting"
# which LoRA adapters run and wait (labels), the gateway's LoRA affinity reads it (workers/lora/metrics.py)
GATEWAY_LORA_INFO = "vllm:lora_requests_info"
GATEWAY_RUNNING = "vllm:num_requests_running"
GATEWAY_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
GATEWAY_POD = "all"  # `worker_id` and `capability` of the pod's total samples

# HTTP heads: the router refuses a request head (request line + headers) larger than this
# (431) and reads a worker's response head up to the same size.
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADER_COUNT = 100  # headers in one request; more is a 431
MAX_URL_BYTES = 8 * 1024  # request target (path and query); longer is a 414

# The file the router writes first into each run directory (worker sockets and status
# files): a start-up sweep removes only directories that hold it.
RUN_DIR_MARKER = ".hetserve-run"
# the host KV tier (workers/kvtier/): its default budget, a share of the host's MemAvailable at a
# worker's start, and the prefix of the per-run directory the router makes under /dev/shm
KV_HOST_SHARE = 0.10
KV_TIER_PREFIX = "hetserve-kv-"

# KV cache sizing defaults (workers/kv/sizing.py), here so `hetserve serve --help` can say them:
# a GPU worker takes this fraction of its free memory after loading; a CPU worker at most this.
GPU_FREE_FRACTION = 0.85
CPU_KV_MAX_DEFAULT_BYTES = 512 << 20

# Why a device neither compiles nor runs the GGUF kernel layer (the plan's and the worker's preflight's
# note): its model holds no GGUF blocks (workers/gguf/execution.py).
NO_GGUF_LAYER = ("the model holds no GGUF blocks on this device: no GGUF file, or one this device dequantizes "
                 "at load")
NO_GGUF_EXPERTS = ("the model holds no GGUF experts on this device: no MoE GGUF file, one this device dequantizes "
                   "at load, or experts of a type its kernel does not decode")
