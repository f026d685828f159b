"""How much KV cache a worker gets, and how many blocks that is: from its own device only.

Design: the budget is read from the bound device, never from another device or a process-wide
answer. A GPU worker takes `GPU_FREE_FRACTION` of its free memory after loading, as vLLM does
(blocks beyond the running batch keep more prefixes cached); a CPU worker without
`--kv-cache-bytes` takes what `--max-batch` sequences of the full context need, at most
`CPU_KV_MAX_DEFAULT_BYTES`, so simulated workers sharing one host stay small.
`--gpu-memory-utilization` budgets a fraction of the device's own memory (a simulated device's
simulated size) for weights and KV together, capped by `--kv-cache-bytes`. Linear layers' state
comes out of the budget first (the CPU default adds it). Trade-off: each worker sizes its cache
alone, so devices of different sizes get budgets of their own size but no worker lends another
its spare memory."""

from __future__ import annotations

# of the bound device's free memory after loading (the rest for activations); a CPU worker's cap
from workers.contract import WorkerConfig
from workers.contract.defaults import CPU_KV_MAX_DEFAULT_BYTES, GPU_FREE_FRACTION

__all__ = ["CPU_KV_MAX_DEFAULT_BYTES", "GPU_FREE_FRACTION", "kv_budget", "plan_kv_blocks"]


def kv_budget(config: WorkerConfig, bound, bytes_per_token: int, context: int,
              state_per_sequence: int = 0, weights_bytes: int = 0) -> tuple[int, str]:
    """This worker's KV cache budget in bytes (the linear layers' state included, `state_per_sequence`
    bytes per sequence), from its own device only, with the reason; `weights_bytes`: what the loaded
    model holds (counted against `--gpu-memory-utilization` on a simulated device). A host CPU
    worker, with no device memory of its own to share out, keeps the CPU default under
    `--gpu-memory-utilization`."""
    fraction = config.gpu_memory_utilization
    if fraction is not None and (bound.is_real_gpu or bound.simulated):
        return _fraction_budget(config, bound, fraction, weights_bytes)
    if bound.is_real_gpu:
        import torch

        free, _total = torch.cuda.mem_get_info(bound.torch_device)
        usable = int(free * GPU_FREE_FRACTION)
        if config.kv_cache_bytes:
            return (min(config.kv_cache_bytes, usable),
                    f"--kv-cache-bytes {config.kv_cache_bytes}, capped at {usable} usable")
        return usable, f"{GPU_FREE_FRACTION:.0%} of the bound device's {free} free bytes after loading"
    if config.kv_cache_bytes:
        return config.kv_cache_bytes, f"--kv-cache-bytes {config.kv_cache_bytes}"
    full = config.max_batch * (context * bytes_per_token + state_per_sequence)
    if full <= CPU_KV_MAX_DEFAULT_BYTES:
        state = " and their linear layers' state" if state_per_sequence else ""
        return full, f"CPU default: {config.max_batch} sequences x {context} tokens of context{state}"
    return CPU_KV_MAX_DEFAULT_BYTES, f"CPU default: at most {CPU_KV_MAX_DEFAULT_BYTES} bytes"


def plan_kv_blocks(bytes_per_token: int, block_size: int, budget: int, context: int) -> tuple[int, str]:
    """(blocks, description) for a budget; raises when not even one block fits."""
    per_block = bytes_per_token * block_size
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"KV cache budget `{budget}` bytes is below one block of {block_size} tokens ({per_block} bytes); "
            f"raise `--kv-cache-bytes` or lower `--kv-block-size`"
        )
    longest = min(context, blocks * block_size)
    return blocks, f"{blocks} blocks x {block_size} tokens ({blocks * block_size} tokens; longest request {longest})"


def _fraction_budget(config: WorkerConfig, bound, fraction: float, weights_bytes: int) -> tuple[int, str]:
    """`--gpu-memory-utilization`: the device's share less what is already taken, capped by
    `--kv-cache-bytes`; a share smaller than what is taken is a named error."""
    if bound.is_real_gpu:
        import torch

        free, total = torch.cuda.mem_get_info(bound.torch_device)
        used, what = total - free, "in use after loading"
    else:
        total, used, what = bound.memory_total_bytes, weights_bytes, "of weights (simulated device)"
    share = int(total * fraction)
    budget = share - used
    if budget <= 0:
        raise ValueError(f"`--gpu-memory-utilization {fraction:g}` gives {share} bytes of the device's {total}, "
                         f"below the {used} bytes {what}; raise it (accepted: 0 < F <= 1)")
    why = f"--gpu-memory-utilization {fraction:g} of the device's {total} bytes, less {used} bytes {what}"
    if config.kv_cache_bytes and config.kv_cache_bytes < budget:
        return config.kv_cache_bytes, f"--kv-cache-bytes {config.kv_cache_bytes} (below {budget}: {why})"
    return budget, why
