"""The torch reference of the GGUF linear kernels: the same per-element decoding, then a matmul.

`dequantize_rows` decodes GGUF blocks to fp32 element by element with the kernel's own index
arithmetic (the byte each element's code, scale and high bits live in), vectorized over the
elements of a block, and each value formed in the order gguf-py's `dequantize` forms it, so the
reference equals gguf-py bit for bit (a test holds it to that) and the kernel equals the reference
within fp32 summation order. `gguf_linear_reference` rounds the weight to the activations' dtype
and runs an fp32 matmul, as the kernels do. Trade-off: a second copy of the index arithmetic
(torch beside Triton) so that the kernel repository stands alone.
"""

from __future__ import annotations

import torch

BLOCKS = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
}
IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def check_layout(qweight: torch.Tensor, type_name: str, in_features: int) -> None:
    """ValueError naming what does not fit: the type, a partial block, or a row of the wrong length."""
    if type_name not in BLOCKS:
        raise ValueError(f"Unsupported GGUF kernel type `{type_name}`. Supported: {', '.join(BLOCKS)}")
    qk, size = BLOCKS[type_name]
    if in_features % qk:
        raise ValueError(f"`{in_features}` inputs are no whole number of `{type_name}` blocks of {qk}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != in_features // qk * size:
        raise ValueError(f"`{type_name}` weight must be uint8 [N, {in_features // qk * size}] for {in_features} "
                         f"inputs; got `{qweight.dtype}` {tuple(qweight.shape)}")


def _decode(b: torch.Tensor, type_name: str) -> torch.Tensor:
    """[n, TYPE_SIZE] uint8 blocks -> [n, QK] fp32, one column per element j."""
    qk, _ = BLOCKS[type_name]
    blocks = b.to(torch.int32)
    j = torch.arange(qk, device=b.device)

    def u8(off):
        return blocks[:, off] if isinstance(off, torch.Tensor) else blocks[:, off:off + 1]

    def f16(off):
        bits = u8(off) | (u8(off + 1) << 8)
        return bits.to(torch.int16).view(torch.float16).float()  # int32 -> int16 keeps the low 16 bits

    def nib(off, shift):
        return (u8(off) >> shift) & 0xF

    def grid(q):
        return torch.tensor(IQ4_GRID, dtype=torch.float32, device=b.device)[q]

    if type_name == "Q8_0":
        return b[:, 2:].view(torch.int8).float() * f16(0)
    if type_name == "Q4_0":
        return f16(0) * (nib(2 + j % 16, 4 * (j // 16)) - 8).float()
    if type_name == "Q4_1":
        return f16(0) * nib(4 + j % 16, 4 * (j // 16)).float() + f16(2)
    if type_name in ("Q5_0", "Q5_1"):
        o = 2 if type_name == "Q5_0" else 4
        q = nib(o + 4 + j % 16, 4 * (j // 16)) | (((u8(o + j // 8) >> (j % 8)) & 1) << 4)
        return f16(0) * (q - 16).float() if type_name == "Q5_0" else f16(0) * q.float() + f16(2)
    if type_name == "IQ4_NL":
        return f16(0) * grid(nib(2 + j % 16, 4 * (j // 16)))
    r = j % 128
    if type_name == "Q2_K":
        s = u8(j // 16)
        q = (u8(16 + (j // 128) * 32 + r % 32) >> (2 * (r // 32))) & 3
        return f16(80) * (s & 0xF).float() * q.float() - f16(82) * (s >> 4).float()
    if type_name == "Q3_K":
        sub = j // 16
        low, high = (u8(96 + sub % 8) >> (4 * (sub // 8))) & 0xF, (u8(104 + sub % 4) >> (2 * (sub // 4))) & 3
        sc = (low | (high << 4)) - 32
        ql = (u8(32 + (j // 128) * 32 + r % 32) >> (2 * (r // 32))) & 3
        q = ql - ((((u8(j % 32) >> (j // 32)) & 1) ^ 1) << 2)
        return (f16(108) * sc.float()) * q.float()
    if type_name in ("Q4_K", "Q5_K"):
        sub = j // 32
        b0, b1, b2 = u8(4 + sub % 4), u8(8 + sub % 4), u8(12 + sub % 4)
        high = sub >= 4
        sc = torch.where(high, (b2 & 0xF) | ((b0 >> 6) << 4), b0 & 63).float()
        mn = torch.where(high, (b2 >> 4) | ((b1 >> 6) << 4), b1 & 63).float()
        o = 16 if type_name == "Q4_K" else 48
        q = nib(o + (j // 64) * 32 + j % 32, 4 * ((j // 32) % 2))
        if type_name == "Q5_K":
            q = q | (((u8(16 + j % 32) >> (j // 32)) & 1) << 4)
        return (f16(0) * sc) * q.float() - f16(2) * mn
    if type_name == "Q6_K":
        ql = nib((j // 128) * 64 + r % 64, 4 * (r // 64))
        qh = (u8(128 + (j // 128) * 32 + r % 32) >> (2 * (r // 32))) & 3
        sc = b[:, 192:208].view(torch.int8).float()[:, j // 16]
        return (f16(208) * sc) * ((ql | (qh << 4)) - 32).float()
    # IQ4_XS
    sub = j // 32
    sc = (((u8(4 + sub // 2) >> (4 * (sub % 2))) & 0xF) | ((((u8(2) | (u8(3) << 8)) >> (2 * sub)) & 3) << 4)) - 32
    q = nib(8 + sub * 16 + (j % 32) % 16, 4 * ((j % 32) // 16))
    return (f16(0) * sc.float()) * grid(q)


def dequantize_rows(qweight: torch.Tensor, type_name: str, in_features: int) -> torch.Tensor:
    """The weight [N, K] in fp32 from its GGUF rows of blocks (uint8 [N, K / QK * TYPE_SIZE])."""
    check_layout(qweight, type_name, in_features)
    qk, size = BLOCKS[type_name]
    n = qweight.shape[0]
    values = _decode(qweight.contiguous().reshape(-1, size), type_name)
    return values.reshape(n, in_features)


def gguf_linear_reference(x: torch.Tensor, qweight: torch.Tensor, type_name: str,
                          bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The torch math: the weight decoded in fp32, rounded to the activations' dtype, an fp32 matmul,
    the bias, the cast."""
    k = x.shape[-1]
    w = dequantize_rows(qweight, type_name, k).to(x.dtype).to(torch.float32)  # [N, K]
    y = x.reshape(-1, k).to(torch.float32) @ w.t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
