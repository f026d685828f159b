"""`GGUFEmbedding`: the token embedding of a tied head kept packed, read from the head's own blocks.

Design: a GGUF model whose head is tied to its embedding (no `output.weight` in the file) holds the
`token_embd` blocks once, in the packed head (`GGUFLinear`, whose GEMV reads them at each decode
step); the embedding shares that `qweight` and decodes only the rows a step looks up, bit for bit
as gguf-py does (kernels_local/gguf_linear's C++ decoder), in the model's dtype. Trade-off: a decode
per lookup (a step's few rows) for a head that reads its blocks instead of a float copy of the
vocabulary, and no such copy resident; only on the CPU, whose decoder runs inside a compiled step
(a GPU keeps the tied head dequantized at load, as before).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels_local.gguf_linear import cpu
from workers.gguf.linear import row_bytes


class GGUFEmbedding(nn.Module):
    """Rows of the GGUF blocks `qweight` [V, H / QK * TYPE_SIZE] of type `gguf_type`, decoded per lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, gguf_type: str, *, dtype: torch.dtype,
                 device: torch.device | str = "meta") -> None:  # fmt: skip
        super().__init__()
        if gguf_type not in cpu.TYPES:
            raise ValueError(f"A packed embedding of GGUF type `{gguf_type}`: the CPU decoder reads "
                             f"{', '.join(cpu.TYPES)}")
        self.num_embeddings, self.embedding_dim, self.gguf_type, self.dtype = (num_embeddings, embedding_dim,
                                                                               gguf_type, dtype)
        self.register_buffer("qweight", torch.empty(num_embeddings, row_bytes(gguf_type, embedding_dim),
                                                    dtype=torch.uint8, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.index_select(0, ids.reshape(-1))  # [T, H / QK * TYPE_SIZE]
        x = cpu.dequantize(rows, self.gguf_type, self.embedding_dim)  # [T, H] float32
        return x.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, gguf_type={self.gguf_type}"
