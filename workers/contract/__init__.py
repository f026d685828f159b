"""The torch-free contract between the router and its workers.

Both processes import this package, and the router imports nothing else from `workers`
except `workers.topology` (import-linter enforces it): the capability type, the device
description, the fp8 rule, the worker's lifecycle values, shared defaults and header names,
the chat-template lookup, the per-architecture Triton cache and the `/capability` payload.
Each fact has one definition here.
"""

from workers.contract.capability import (
    ACCEPTED_CAPABILITY_SPELLINGS,
    Capability,
    CapabilityError,
    capability_label,
)
from workers.contract.chat_template import (
    FoundTemplate,
    find_chat_template,
    read_special_tokens,
    read_tokenizer_config,
    token_text,
)
from workers.contract.defaults import (
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MODEL_DIR,
    DRAIN_TIMEOUT_S,
    ENV_DEVICE_INDEX,
    ENV_DEVICE_UUID,
    ENV_PREFLIGHT,
    ENV_SIMULATE,
    ENV_TEST_PERTURB_LOGITS,
    HEADER_FP8,
    HEADER_FP8_CONVENTION,
    HEADER_MIN_CAPABILITY,
    HEADER_PIN_WORKER,
    HEADER_WORKER_CAPABILITY,
    HEADER_WORKER_ID,
    KV_BLOCK_SIZES,
    MAX_HEADER_BYTES,
    MAX_HEADER_COUNT,
    MAX_LOGPROBS,
    MAX_STOP_SEQUENCES,
    MAX_URL_BYTES,
    PREFLIGHT_MODES,
    RESUME_IDS,
    RUN_DIR_MARKER,
    WORKER_HEADERS,
    engine_limits_error,
)
from workers.contract.device import DEVICE_FIELDS, DeviceDescribing, DeviceInfo
from workers.contract.fp8_rule import (
    DEVICE_TYPES,
    EMULATED,
    FP8_CONVENTIONS,
    NATIVE,
    NATIVE_FP8_CAPABILITY,
    ROCM_NATIVE_FP8_CAPABILITY,
    ROCM_NATIVE_FP8_LAST,
    ROCM_OCP_FP8_CAPABILITY,
    Fp8Decision,
    fp8_rule,
)
from workers.contract.json_schema import load_json_schema
from workers.contract.lifecycle import STARTUP_STEPS, ExitCode, WorkerState, WorkerStatus
from workers.contract.payload import (
    CapabilityPayload,
    DeterministicDescription,
    DeviceDescription,
    EngineLiveness,
    Fp8Description,
    HealthPayload,
    KernelDescription,
    ModelDescription,
)
from workers.contract.triton_cache import (
    ENV_TRITON_CACHE,
    ENV_TRITON_CACHE_DIR,
    triton_cache_dir,
    triton_cache_root,
    use_triton_cache,
)

__all__ = [
    "ACCEPTED_CAPABILITY_SPELLINGS", "Capability", "CapabilityError", "capability_label",
    "FoundTemplate", "find_chat_template", "read_special_tokens", "read_tokenizer_config", "token_text",
    "DEFAULT_KV_BLOCK_SIZE", "DEFAULT_MAX_BATCH", "DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_QUEUE",
    "DEFAULT_MODEL_DIR", "DRAIN_TIMEOUT_S", "KV_BLOCK_SIZES", "engine_limits_error",
    "ENV_DEVICE_INDEX", "ENV_DEVICE_UUID", "ENV_PREFLIGHT", "ENV_SIMULATE", "ENV_TEST_PERTURB_LOGITS",
    "PREFLIGHT_MODES",
    "HEADER_FP8", "HEADER_FP8_CONVENTION", "HEADER_MIN_CAPABILITY", "HEADER_PIN_WORKER",
    "HEADER_WORKER_CAPABILITY", "HEADER_WORKER_ID", "MAX_LOGPROBS", "MAX_STOP_SEQUENCES", "RESUME_IDS",
    "WORKER_HEADERS", "MAX_HEADER_BYTES", "MAX_HEADER_COUNT", "MAX_URL_BYTES", "RUN_DIR_MARKER",
    "DEVICE_FIELDS", "DeviceDescribing", "DeviceInfo",
    "DEVICE_TYPES", "EMULATED", "FP8_CONVENTIONS", "NATIVE", "NATIVE_FP8_CAPABILITY", "ROCM_NATIVE_FP8_CAPABILITY",
    "ROCM_NATIVE_FP8_LAST", "ROCM_OCP_FP8_CAPABILITY",
    "Fp8Decision", "fp8_rule",
    "load_json_schema",
    "STARTUP_STEPS", "ExitCode", "WorkerState", "WorkerStatus",
    "ENV_TRITON_CACHE", "ENV_TRITON_CACHE_DIR", "triton_cache_dir", "triton_cache_root", "use_triton_cache",
    "CapabilityPayload", "DeterministicDescription", "DeviceDescription", "EngineLiveness", "Fp8Description", "HealthPayload",
    "KernelDescription", "ModelDescription",
]
