"""How much KV cache a worker gets, and how it is shaped: from its own device only.

The budget is read from the bound device (its free memory after the model is loaded, or a
fixed CPU default), never from another device or a process-wide answer. The shape trades
slots against length: `max_batch` slots as long as the budget allows, down to a floor of
`MIN_SEQ_LEN` tokens (or the model's context); below that floor, fewer slots of that
length, so a small card serves fewer sequences rather than uselessly short ones.
"""

from __future__ import annotations

import argparse

GPU_FREE_FRACTION = 0.85  # of the bound device's free memory after loading; the rest for activations
CPU_KV_DEFAULT_BYTES = 512 << 20
MIN_SEQ_LEN = 512


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
