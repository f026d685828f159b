"""The worker's C++ kernels let go of the GIL while they run (called through `torch.ops`, from
kernels_local/paged_attention/cpu_decode.cpp and kernels_local/panel_linear/cpu_gemm.cpp).

Why it matters: the engine thread calls them inside every step, and the worker's HTTP thread
turns the previous step's tokens into frames meanwhile; a kernel holding the GIL stalls that
thread for its whole call, and the engine then waits for the HTTP thread in turn. Checked the
way a user would see it: a second Python thread keeps running during one long kernel call.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kernels_local.paged_attention import cpu as cpu_decode
from kernels_local.panel_linear import cpu as cpu_gemm


def _ticks_during(call) -> tuple[int, float]:
    """How often a second Python thread ran during `call()` (its middle 80%), and the call's seconds."""
    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    while not stamps:  # the thread runs before the call starts
        time.sleep(0.001)
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    thread.join()
    lo, hi = t0 + 0.1 * (t1 - t0), t1 - 0.1 * (t1 - t0)
    return sum(lo < s < hi for s in stamps), t1 - t0


def _long_enough(call) -> None:
    call()  # the first call through a custom op sets itself up in Python
    ticks, seconds = _ticks_during(call)
    assert seconds > 0.02, f"the call took {seconds * 1e3:.1f} ms: too short to tell"
    assert ticks > 100, f"another thread ran {ticks} times in a {seconds * 1e3:.0f} ms kernel call: the GIL was held"


def test_the_decode_kernel_releases_the_gil():
    """Guards the call of `paged_decode` (cpu_decode.cpp) through `torch.ops`, which lets go of the
    GIL: a call that kept it (a pybind11 binding without a release guard) stops the other thread."""
    if not cpu_decode.load().available:
        pytest.skip(cpu_decode.load().reason)
    n, kv_heads, block, width = 256, 8, 16, 64
    kv = torch.randn(2, kv_heads, n * width // 4, block, 64)
    tables = torch.randint(0, n * width // 4, (n, width))
    lens = torch.full((n,), width * block)
    q = torch.randn(n, kv_heads * 2, 64)
    _long_enough(lambda: cpu_decode.paged_decode_cpu(q, kv, tables, lens, 0, 0.125, 0.0, None))


def test_the_panel_gemm_releases_the_gil():
    """Guards the call of `panel_linear` (cpu_gemm.cpp) through `torch.ops`, as the decode kernel's."""
    if not cpu_gemm.load().available:
        pytest.skip(cpu_gemm.load().reason)
    weight, rows = torch.randn(8192, 2048), torch.randn(1024, 2048)
    layout = cpu_gemm.panels(weight)
    _long_enough(lambda: cpu_gemm.linear(rows, layout, None))


@pytest.mark.parametrize("kernel", ["rms_norm", "silu_and_mul", "rotary", "greedy"])
def test_the_cpu_kernels_registered_as_torch_ops_release_the_gil(kernel):
    """The C++ kernels registered as `torch.ops.hetserve_cpu` operators (kernels_local/cpp_build.py
    `CppKernel`) run with the GIL let go by torch's operator call, as the two kernels above do."""
    from kernels_local.activation import cpu as activation
    from kernels_local.rmsnorm import cpu as rmsnorm
    from kernels_local.rotary import cpu as cpu_rotary
    from kernels_local.sampling import cpu as cpu_greedy

    owner = {"rms_norm": rmsnorm, "silu_and_mul": activation, "rotary": cpu_rotary, "greedy": cpu_greedy}[kernel]
    if not owner.KERNEL.load().available:
        pytest.skip(owner.KERNEL.load().reason)
    ops = owner.KERNEL.module
    args = {  # made before the call: only the kernel runs while the other thread is counted
        "rms_norm": (torch.randn(1 << 15, 1024), torch.ones(1024), 1e-6),
        "silu_and_mul": (torch.randn(1 << 14, 2048),),
        "rotary": (torch.randn(1 << 14, 16, 128), torch.randn(1 << 14, 1, 64), torch.randn(1 << 14, 1, 64)),
        "greedy": (torch.randn(1 << 10, 1 << 15),),
    }[kernel]
    _long_enough(lambda: getattr(ops, kernel)(*args))
