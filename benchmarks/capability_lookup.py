"""Cost of a capability lookup after binding, side by side with an lru_cache'd lookup.

    .venv/bin/python benchmarks/capability_lookup.py [--simulate sm_90]

Binding happens once; afterwards `capability()` is a read of the bound device's frozen field.
The `kernels` library's `_find_capability` (an lru_cache over the current device) is shown for
comparison with the same kind of fake capability source, since this host has no CUDA.
"""

from __future__ import annotations

import argparse
import functools
import timeit

from workers.device.bind import bind_device, capability


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--simulate", default="sm_90")
    p.add_argument("--number", type=int, default=1_000_000)
    args = p.parse_args()
    bind_device(simulate=args.simulate)

    @functools.lru_cache
    def lru_capability() -> int:
        return 90

    ours = min(timeit.repeat(capability, number=args.number, repeat=5)) / args.number * 1e9
    theirs = min(timeit.repeat(lru_capability, number=args.number, repeat=5)) / args.number * 1e9
    print(f"capability() after binding : {ours:7.1f} ns/call  -> {capability()}")
    print(f"lru_cache'd lookup          : {theirs:7.1f} ns/call")
    print(f"ratio ours / lru_cache      : {ours / theirs:7.2f}x")


if __name__ == "__main__":
    main()
