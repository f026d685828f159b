"""What `/capability` says of this worker: device, kernels, fp8, model, capacity, compile, pipeline.

Design: one `CapabilityPayload`, built by the serve step in workers/main.py from the values the
earlier steps returned (the bound device, the kernel choices, the fp8 convention and what uses
it, the preflight, the CPU's own paths, the built engine); nothing is read back from module
state, and workers/serving/ receives the finished value. The fp8 part (`fp8_description`) is
also what a pipeline's later stage reports of itself to the first (workers/pipeline/follower.py).
The compile part is described again after the `compile` step, which may fall back to eager.
Trade-off: the payload is assembled from many small values, each named at the call, rather than
read off one object that holds everything.
"""

from __future__ import annotations

import os
from importlib import metadata

from kernels_local.activation import cpu as activation
from kernels_local.mapping import KernelChoice
from kernels_local.rmsnorm import cpu as rmsnorm
from workers.contract import ENV_TRITON_CACHE_DIR, CapabilityPayload, WorkerConfig
from workers.contract.payload import CompileDescription
from workers.device.bind import BoundDevice
from workers.engine.build import BuiltEngine, CpuPaths
from workers.engine.compiled import CompiledDecode, CompileDecision
from workers.gguf.execution import gguf_execution
from workers.kernelize.records import Preflight
from workers.model.describe import describe
from workers.model.loader import LoadedModel
from workers.quant.fp8_convention import Fp8Convention


def fp8_description(conv: Fp8Convention, reason: str, quantize: str, checkpoint: dict | None, loaded: LoadedModel,
                    preflight: Preflight | None = None) -> dict:
    """The device's convention and why, whether any layer computes from fp8 bytes (`--quantize
    fp8`, an fp8 checkpoint) and the label the ready line, `X-Fp8-Convention` and the status page
    show: the convention when used, else `not used (<dtype>)`, so a device's fp8 capability never
    reads as fp8 on; with how this device runs a checkpoint's fp8 layers, and where fp8 is emulated
    the preflight's proof that the native kernel does not compile here."""
    from_checkpoint = checkpoint is not None and (checkpoint.get("layers", 0) + checkpoint.get("expert_layers", 0)) > 0
    used = quantize == "fp8" or from_checkpoint
    if not used:
        label = f"not used ({str(loaded.dtype).removeprefix('torch.')})"
    else:
        label = f"{conv.name} (checkpoint, {checkpoint['execution']})" if from_checkpoint else conv.name
    fp8 = {"convention": conv.name, "reason": reason, "used": used, "label": label}
    if checkpoint is not None:
        fp8["checkpoint"] = {**checkpoint, "quantization": loaded.quantization}
    if preflight is not None and preflight.native_fp8 is not None:
        fp8["native_compile"] = preflight.native_fp8.to_dict()
    return fp8


def kernel_description(kernels: dict[str, KernelChoice], cpu: CpuPaths, preflight: Preflight | None) -> dict:
    """Each layer's kernel choice; on a CPU what its decode attention and C++ kernels run (and why
    not), and each layer's compile record where the preflight ran."""
    out = {k: v.to_dict() for k, v in kernels.items()}
    if cpu.decode_attention is not None and "PagedAttention" in out:
        out["PagedAttention"]["cpu_decode"] = cpu.decode_attention
    for layer, stem in (("RMSNorm", rmsnorm.KERNEL.stem), ("SiluAndMul", activation.KERNEL.stem)):
        if layer in out and out[layer]["variant"] == "cpp" and stem in cpu.kernels:  # whether its C++ built here
            out[layer]["cpu_kernel"] = cpu.kernels[stem]
    if preflight is not None:
        for layer, entry in out.items():
            entry["compiled"] = preflight.layers[layer].compiled()
    return out


def model_description(loaded: LoadedModel, context: int, device_type: str = "cpu", capability=None) -> dict:
    """The model as served: id, dtype, context, family, features, attention per layer type, its
    template and special tokens, and its recommended sampling (generation_config.json, which the
    OpenAI routes apply to fields a request leaves out, as vLLM does)."""
    described = describe(loaded.config)
    model = {"id": loaded.model_id, "dtype": str(loaded.dtype).removeprefix("torch."), "context_length": context,
             "architecture": described["architecture"], "features": described["features"],
             "attention": described["attention"]}
    for key in ("chat_template", "eos_token", "bos_token"):
        if getattr(loaded, key) is not None:
            model[key] = getattr(loaded, key)
    model["sampling_defaults"] = {k: loaded.generation_config[k]
                                  for k in ("temperature", "top_p", "top_k", "repetition_penalty")
                                  if isinstance(loaded.generation_config.get(k), (int, float))}
    gguf = gguf_execution(loaded.model_dir, loaded.dtype, device_type, capability, loaded.model)
    if gguf is not None:  # a GGUF file: how this device runs its blocks, and why
        model["gguf"] = gguf
    return model


def compile_description(decision: CompileDecision, compiled: CompiledDecode | None) -> CompileDescription:
    return CompileDescription(mode=decision.mode, enabled=decision.enabled, backend=decision.backend,
                              reason=decision.reason, **(compiled.describe() if compiled is not None else {}))


def describe_worker(config: WorkerConfig, bound: BoundDevice, loaded: LoadedModel, kernels: dict[str, KernelChoice],
                    fp8: dict, preflight: Preflight | None, cpu: CpuPaths, built: BuiltEngine, context: int,
                    pipeline: dict | None = None) -> CapabilityPayload:
    """This worker's `/capability` answer (but for `pid` and `load`, filled in per request)."""
    kv = built.kv
    capacity = {**built.engine.scheduler.capacity(), "kv_cache_bytes": kv.nbytes,
                "kv_groups": [{"window": g.window, "layers": len(g.layers), "blocks": g.num_blocks,
                               "kv_heads": g.kv_heads, "head_dim": g.head_dim} for g in kv.groups],
                **({"state_bytes": kv.states.nbytes} if kv.states is not None else {})}
    return CapabilityPayload(
        worker_id=config.worker_id,
        device=bound.to_dict(),
        fp8=fp8,
        kernels=kernel_description(kernels, cpu, preflight),
        triton_cache=os.environ.get(ENV_TRITON_CACHE_DIR),
        capacity=capacity,
        model=model_description(loaded, context, bound.arch or bound.type, bound.capability),
        versions=_versions(),
        deterministic=cpu.deterministic.to_dict() if cpu.deterministic else None,
        compile=compile_description(built.decision, built.compiled),
        speculative=built.engine.speculation(),
        pipeline=pipeline,
    )


def _versions() -> dict:
    out = {}
    for name in ("hetserve", "torch", "triton", "kernels"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
