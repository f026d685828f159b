"""Llama-family decoder (Llama 2/3/3.x, Mistral, Qwen2) in plain torch.

Design (gpt-fast style): `Transformer.from_config` builds the module on the meta device,
and the loader assigns real tensors with `load_state_dict(..., assign=True)`, so weights
are never allocated twice. Projections are fused (`wqkv`, `w_gate_up`) so each layer runs
four matmuls over all packed tokens of a step; they stay `nn.Linear` so fp8 quantisation
can swap them. RMSNorm and SiluAndMul are kernel-swappable layers (workers.model.layers).

Two entry points share the weights:
- `model(input_ids [B, S]) -> logits [B, S, V]`: full causal forward, no cache (parity
  tests, training);
- `model.step(batch, kv) -> logits [N, V] fp32`: one engine step over packed chunks
  (prefills of any length plus one-token decodes at any position), writing K/V into the
  paged cache and projecting only the rows the batch asks for (each sampling chunk's last
  token; any positions, e.g. for prompt logprobs) to the vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.kv.batch import ForwardBatch
from workers.kv.pool import KVPool
from workers.model.attention import Attention, build_step_context
from workers.model.config import ModelConfig
from workers.model.layers import RMSNorm, SiluAndMul
from workers.model.rope import RotaryTables


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.act = SiluAndMul()
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(self.act(self.w_gate_up(x)))  # [..., H] -> [..., 2I] -> [..., I] -> [..., H]


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer_index)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)  # [B, S, H]
        return h + self.feed_forward(self.ffn_norm(h))

    def step(self, x: torch.Tensor, ctx) -> torch.Tensor:
        h = x + self.attention.step(self.attention_norm(x), ctx)  # [T, H]
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = RotaryTables(config)
        self.tie_weights()

    # ---- construction ------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: ModelConfig, dtype: torch.dtype = torch.float32) -> Transformer:
        """Build on the meta device (no memory) in `dtype`. Load weights with `load_weights` (or
        `load_state_dict(sd, assign=True)` then `tie_weights()`): they bring their device."""
        with torch.device("meta"):
            model = cls(config)
        model.to(dtype=dtype)
        return model

    @classmethod
    def random(
        cls,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        std: float = 0.02,
    ) -> Transformer:
        """A materialised model with random weights (training from scratch, tests)."""
        model = cls.from_config(config, dtype)
        model.to_empty(device=device)
        model.tie_weights()
        model.init_weights(seed, std)
        return model

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Normal(0, std) for matrices, zeros for biases, ones for norms (GPT-2 style)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def load_weights(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Assign `state_dict` (our names, already in the right dtype/device) and re-tie."""
        sd = dict(state_dict)
        if self.config.tie_word_embeddings:
            sd.setdefault("output.weight", sd.get("tok_embeddings.weight"))
        self.load_state_dict(sd, strict=strict, assign=True)
        self.tie_weights()

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def new_kv_pool(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> KVPool:
        return KVPool.for_config(self.config, num_blocks, block_size, dtype or self.dtype, self.device)

    # ---- forward passes --------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward: input_ids [B, S] -> logits [B, S, V] (model dtype)."""
        seq_len = input_ids.shape[1]
        cos, sin = self.rope.lookup_range(seq_len, input_ids.device, self.dtype)  # [S, 1, D/2]
        x = self.tok_embeddings(input_ids)  # [B, S, H]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))  # [B, S, V]

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        """One engine step: logits [N, V] fp32 at the rows of `batch.logits_index`."""
        if batch.max_block >= kv.num_blocks or batch.block_size != kv.block_size:
            raise ValueError(
                f"Batch reads block `{batch.max_block}` of size {batch.block_size}; the KV pool has "
                f"{kv.num_blocks} blocks of size {kv.block_size}"
            )
        cos, sin = self.rope.lookup(batch.positions, batch.max_pos, self.dtype)  # [T, 1, D/2]
        ctx = build_step_context(batch, kv, cos, sin)
        x = self.tok_embeddings(batch.input_ids)  # [T, H]
        for layer in self.layers:
            x = layer.step(x, ctx)
        if x.shape[0] != batch.logits_index.shape[0]:  # equal only when every row is projected, in order
            x = x.index_select(0, batch.logits_index)  # [N, H]
        return self.output(self.norm(x)).float()  # [N, V]
