"""The torch-free contract between the router and its workers: each fact they share, defined once.

Both processes import this package, and the router imports nothing else from `workers` (import-
linter enforces it). Its modules: the devices (`capability`, `device`, the simulated `catalog` and
`topology`, byte `sizes`, the slowed simulated devices' `slowdown`); the rules placement and the
worker both apply (`fp8_rule`, `int4_rule`, `mxfp4_rule`, `dtypes`, `model_size`,
`checkpoint_check`); the worker's configuration (`config`: `WorkerConfig`, written as JSON by the
router, read by the worker), its `lifecycle`, `defaults` and per-architecture `triton_cache`; what
crosses the socket (`request`: `WorkerRequest`, the one shape of a generation request, with its
`limits`, `json_schema` and `chat_template`; `wire`: the tokenize, detokenize, embed and abort
bodies; `payload`: `/capability` and `/health`; `events`: a request's token events and their binary
form on the stream channel; `detokenize` and `render`: their text, on either side; `errors`); and
the pipelines' `pipeline` plan and `stage_timing`. Code outside the contract imports these names
from here; `tracing`, shared too, is imported as its own module: it loads OpenTelemetry only when
asked to."""

from workers.contract.capability import (
    ACCEPTED_CAPABILITY_SPELLINGS,
    Capability,
    CapabilityError,
    capability_label,
)
from workers.contract.chat_template import (
    JINJA_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    FoundTemplate,
    find_chat_template,
    read_special_tokens,
    read_tokenizer_config,
    token_text,
)
from workers.contract.config import WorkerConfig, WorkerConfigError
from workers.contract.defaults import (
    COMPILE_MODES,
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MODEL_DIR,
    DRAIN_TIMEOUT_S,
    ENV_COMPILE,
    ENV_DEVICE_INDEX,
    ENV_DEVICE_UUID,
    ENV_PREFLIGHT,
    ENV_SIMULATE,
    GATEWAY_KV_USAGE,
    GATEWAY_LORA_INFO,
    GATEWAY_POD,
    GATEWAY_RUNNING,
    GATEWAY_WAITING,
    HEADER_CHANNEL,
    HEADER_FP8,
    HEADER_FP8_CONVENTION,
    HEADER_MIN_CAPABILITY,
    HEADER_MODEL,
    HEADER_PIN_WORKER,
    HEADER_STREAM_KEY,
    HEADER_TEXT,
    HEADER_VOCAB,
    HEADER_WORKER_CAPABILITY,
    HEADER_WORKER_ID,
    KV_BLOCK_SIZES,
    KV_HOST_SHARE,
    KV_TIER_PREFIX,
    MAX_HEADER_BYTES,
    MAX_HEADER_COUNT,
    MAX_URL_BYTES,
    PREFLIGHT_MODES,
    RESUME_IDS,
    RUN_DIR_MARKER,
    TEXT_IDS,
    WORKER_HEADERS,
    engine_limits_error,
    step_token_budget,
)
from workers.contract.device import DEVICE_FIELDS, DeviceDescribing, DeviceInfo
from workers.contract.fp8_rule import (
    DEVICE_TYPES,
    EMULATED,
    FP8_CONVENTIONS,
    FP8_DEQUANTIZED,
    FP8_EXECUTIONS,
    FP8_NATIVE,
    FP8_WEIGHT_ONLY,
    NATIVE,
    NATIVE_FP8_CAPABILITY,
    ROCM_NATIVE_FP8_CAPABILITY,
    ROCM_NATIVE_FP8_LAST,
    ROCM_OCP_FP8_CAPABILITY,
    WEIGHT_ONLY_FP8_CAPABILITY,
    Fp8Decision,
    Fp8Execution,
    fp8_execution,
    fp8_rule,
)
from workers.contract.json_schema import load_json_schema
from workers.contract.lifecycle import STARTUP_STEPS, ExitCode, WorkerState, WorkerStatus
from workers.contract.limits import (
    DEFAULT_MAX_NEW_TOKENS,
    GRAMMAR_TYPES,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    grammar_value,
    valid_unicode,
)
from workers.contract.payload import (
    CapabilityPayload,
    CompileDescription,
    DeterministicDescription,
    DeviceDescription,
    EngineLiveness,
    Fp8Description,
    HealthPayload,
    KernelDescription,
    Load,
    ModelDescription,
)
from workers.contract.request import (
    MIN_TEMPERATURE,
    GenerationParameters,
    Grammar,
    WorkerRequest,
    request_error,
)
from workers.contract.sizes import ACCEPTED_SIZES, SizeError, format_size, human, parse_size
from workers.contract.topology import (
    ACCEPTED_DEVICES,
    ACCEPTED_TOKENS,
    TopologySpecError,
    cpu_device,
    parse_simulate,
    parse_token,
    select_devices,
    simulated_device,
)
from workers.contract.triton_cache import (
    ENV_TRITON_CACHE,
    ENV_TRITON_CACHE_DIR,
    triton_cache_dir,
    triton_cache_root,
    use_triton_cache,
)
from workers.contract.wire import (
    MAX_EMBED_INPUTS,
    POOLINGS,
    AbortStreams,
    DetokenizeRequest,
    EmbedRequest,
    LoraAdapterRequest,
    TokenizeRequest,
    WireRequest,
    wire_bytes,
)

__all__ = [
    "ACCEPTED_CAPABILITY_SPELLINGS", "Capability", "CapabilityError", "capability_label", "JINJA_FILE",
    "TOKENIZER_CONFIG", "TOKENIZER_FILE", "FoundTemplate", "find_chat_template", "read_special_tokens",
    "read_tokenizer_config", "token_text", "DEFAULT_KV_BLOCK_SIZE", "DEFAULT_MAX_BATCH",
    "CPU_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_QUEUE", "DEFAULT_MODEL_DIR",
    "DRAIN_TIMEOUT_S",
    "ENV_DEVICE_INDEX", "ENV_DEVICE_UUID", "ENV_COMPILE", "ENV_PREFLIGHT", "ENV_SIMULATE",
    "GATEWAY_KV_USAGE", "GATEWAY_POD", "GATEWAY_RUNNING", "GATEWAY_WAITING", "GATEWAY_LORA_INFO", "HEADER_FP8",
    "HEADER_CHANNEL", "HEADER_FP8_CONVENTION", "HEADER_MIN_CAPABILITY", "HEADER_MODEL", "HEADER_PIN_WORKER",
    "HEADER_STREAM_KEY", "HEADER_TEXT", "HEADER_VOCAB", "TEXT_IDS", "HEADER_WORKER_CAPABILITY",
    "HEADER_WORKER_ID", "KV_BLOCK_SIZES", "MAX_HEADER_BYTES", "MAX_HEADER_COUNT", "MAX_URL_BYTES",
    "PREFLIGHT_MODES", "COMPILE_MODES", "WorkerConfig", "WorkerConfigError", "RESUME_IDS", "RUN_DIR_MARKER",
    "KV_HOST_SHARE", "KV_TIER_PREFIX", "WORKER_HEADERS", "engine_limits_error", "step_token_budget",
    "DEVICE_FIELDS", "DeviceDescribing", "DeviceInfo", "DEVICE_TYPES", "EMULATED", "FP8_CONVENTIONS",
    "NATIVE", "NATIVE_FP8_CAPABILITY", "ROCM_NATIVE_FP8_CAPABILITY", "ROCM_NATIVE_FP8_LAST",
    "ROCM_OCP_FP8_CAPABILITY", "Fp8Decision", "fp8_rule", "FP8_DEQUANTIZED", "FP8_EXECUTIONS", "FP8_NATIVE",
    "FP8_WEIGHT_ONLY", "WEIGHT_ONLY_FP8_CAPABILITY", "Fp8Execution", "fp8_execution", "load_json_schema",
    "STARTUP_STEPS", "ExitCode",
    "WorkerState", "WorkerStatus", "DEFAULT_MAX_NEW_TOKENS", "GRAMMAR_TYPES", "MAX_LOGIT_BIAS",
    "MAX_LOGIT_BIAS_TOKENS", "MAX_LOGPROBS", "MAX_PENALTY", "MAX_SEED", "MAX_STOP_SEQUENCES", "grammar_value",
    "valid_unicode", "CapabilityPayload", "CompileDescription", "DeterministicDescription", "DeviceDescription",
    "EngineLiveness",
    "Fp8Description", "HealthPayload", "KernelDescription", "Load", "ModelDescription", "ACCEPTED_DEVICES",
    "ACCEPTED_TOKENS", "TopologySpecError", "cpu_device", "parse_simulate", "parse_token", "select_devices",
    "simulated_device", "ACCEPTED_SIZES", "SizeError", "format_size", "human", "parse_size", "ENV_TRITON_CACHE",
    "ENV_TRITON_CACHE_DIR", "triton_cache_dir", "triton_cache_root",
    "use_triton_cache", "MIN_TEMPERATURE", "GenerationParameters", "Grammar", "WorkerRequest", "request_error",
    "MAX_EMBED_INPUTS", "POOLINGS", "AbortStreams", "LoraAdapterRequest", "DetokenizeRequest", "EmbedRequest",
    "TokenizeRequest", "WireRequest", "wire_bytes",
]
