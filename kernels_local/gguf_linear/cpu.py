"""GGUF blocks kept packed on the CPU: a C++ GEMV over the file's bytes (`cpu_gguf.cpp`).

A decode step's projection reads each weight once for a handful of rows, so its time is the bytes
it reads: Q4_K holds a weight in 0.28x the bytes of bf16 and 0.14x of float32. `gguf_linear_cpu`
takes each output row's blocks one at a time and every activation row's dot product with the block
while it is in L1; on AVX2 the codes are widened in registers straight into the multiply-adds,
elsewhere the block is decoded into a float32 buffer exactly as gguf-py does. From `GEMV_MAX_M`
rows on (a prompt's, where the matmul is compute-bound), the same decoder dequantizes the weight 256
rows at a time into a buffer the calling thread keeps (256 x K floats, held for the process's life:
no fresh pages per call), and torch's matmul multiplies each panel while it is in cache. Built once
per host (kernels_local/cpp_build.py); where it does not build, the worker dequantizes at load
(workers/gguf/execution.py says so). The trade-off: the sums are the kernel's own (the K-quants'
mins taken from sums of x), so an output may differ from the dequantized matmul's in its last
float32 bits; and a second decoder beside the torch reference's, for the five types measured here
(Q8_0, Q4_0, Q4_K, Q5_K, Q6_K: the Q4_K_M and Q5_K_M mixes, Q4_0 and Q8_0 files).
`int8=True` runs the other GEMV (on AVX2): each activation row rounded to 8 bits per 256 inputs, as
llama.cpp rounds its activations (Q8_K), its codes multiplied with the blocks' in byte multiply-adds,
the exact product of the dequantized weight with the rounded rows (`round_rows_reference`). It trades
the activations' last bits (a served model's logits move off transformers' by far more than 1e-4) for
about twice the GEMV's speed; a worker takes it only when asked (`--gguf-activations int8`).
Timings: docs/benchmarks.md "GGUF on the CPU".
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels_local.cpp_build import CppKernel

ENV_CPU_GGUF = "HETSERVE_CPU_GGUF"  # "off": the worker dequantizes GGUF blocks at load
TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_K": 2, "Q5_K": 3, "Q6_K": 4}  # cpu_gguf.cpp's `Type` codes
# from this many rows on, panels of the weight dequantized per call and torch's matmul (cpu_gguf.cpp's kGemvMaxM)
GEMV_MAX_M = 16


def dequantize(qweight: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """The blocks uint8 [N, K / QK * TYPE_SIZE] -> float32 [N, K], equal to gguf-py's `dequantize`."""
    return torch.ops.hetserve_cpu.gguf_dequantize(qweight, TYPES[type_name], in_features)


def _fake_linear(x: torch.Tensor, qweight: torch.Tensor, type_code: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], qweight.shape[0])  # [..., N]


def round_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """float32 rows [M, K] as the int8 GEMV rounds them: per 256 inputs (the tail fewer), codes
    round(x * 127 / max|x|) (half to even) times max|x| / 127, in float32."""
    rows = x.to(torch.float32)
    out = torch.empty_like(rows)
    for g0 in range(0, rows.shape[-1], 256):
        part = rows[:, g0 : g0 + 256]
        amax = part.abs().amax(dim=-1, keepdim=True)  # [M, 1]
        inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        out[:, g0 : g0 + 256] = torch.round(part * inv) * (amax / 127.0)
    return out


def int8_runs() -> bool:
    """Whether `int8=True` runs the int8 GEMV here (AVX2), not the exact one in its place."""
    return KERNEL.load().available and bool(torch.ops.hetserve_cpu.gguf_int8())


def _fake_dequantize(qweight: torch.Tensor, type_code: int, in_features: int) -> torch.Tensor:
    return qweight.new_empty(qweight.shape[0], in_features, dtype=torch.float32)  # [N, K]


KERNEL = CppKernel("hetserve_cpu_gguf", Path(__file__).with_name("cpu_gguf.cpp"), ENV_CPU_GGUF,
                   "C++ GEMV over GGUF blocks", ("-ffp-contract=off", "-fopenmp"),
                   fakes={"gguf_linear": _fake_linear, "gguf_linear_int8": _fake_linear,
                          "gguf_dequantize": _fake_dequantize})


def runs_cpp(x: torch.Tensor, type_name: str) -> bool:
    """Whether `gguf_linear_cpu` runs the kernel for `x` and blocks of `type_name`."""
    return x.device.type == "cpu" and type_name in TYPES and KERNEL.load().available


def gguf_linear_cpu(x: torch.Tensor, qweight: torch.Tensor, type_name: str, bias: torch.Tensor | None,
                    int8: bool = False) -> torch.Tensor:  # fmt: skip
    """x [..., K] @ W.T + bias -> [..., N] in x's dtype, W the blocks `qweight` of `type_name` (one of
    `TYPES`), the products in float32; where it runs (`runs_cpp`). One C++ operator, eager or inside a
    compiled step (its shape rule registered at load: no Python between the graph and the kernel).
    `int8`: a decode's rows through the int8 GEMV (module docstring); a prompt's are never rounded."""
    op = torch.ops.hetserve_cpu.gguf_linear_int8 if int8 else torch.ops.hetserve_cpu.gguf_linear
    return op(x, qweight, TYPES[type_name], bias)
